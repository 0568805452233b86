package idemkey_test

import (
	"testing"

	"golang.org/x/tools/go/analysis"
	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/txbox/txbox/lint/idemkey"
)

// TestAnalyzer checks the fixtures under testdata/src: every line with a
// "// want" comment must get exactly that diagnostic and every other line
// none, so the negatives (keyed requests, reads, unknown methods, code not
// reached from a handler, opt-outs) are covered as much as the positives.
func TestAnalyzer(t *testing.T) {
	analysistest.Run(t, analysistest.TestData(), idemkey.Analyzer, "consumer", "noconsumer")
}

// TestAnalyzerIsValid guards what other drivers (multichecker,
// golangci-lint) rely on: a valid analyzer under a stable name.
func TestAnalyzerIsValid(t *testing.T) {
	if err := analysis.Validate([]*analysis.Analyzer{idemkey.Analyzer}); err != nil {
		t.Fatal(err)
	}
	if idemkey.Analyzer.Name != "idemkey" {
		t.Fatalf("Analyzer.Name = %q, want idemkey", idemkey.Analyzer.Name)
	}
}
