// Command txbox-lint runs txbox's static checks, currently the idemkey
// analyzer, which reports non-idempotent HTTP and stripe-go calls without
// an idempotency key in Watermill handlers.
//
// Standalone, on package patterns:
//
//	txbox-lint ./...
//
// As a vet tool, alongside the go command's build configuration:
//
//	go vet -vettool=$(which txbox-lint) ./...
//
// Run txbox-lint -help for the flags, e.g. -test=false to skip test files
// or -json for machine-readable output.
package main

import (
	"golang.org/x/tools/go/analysis/singlechecker"

	"github.com/txbox/txbox/lint/idemkey"
)

func main() {
	// singlechecker handles both modes: given package patterns it loads
	// them itself; invoked by go vet with a *.cfg file it runs as a unit
	// checker on the package described there.
	singlechecker.Main(idemkey.Analyzer)
}
