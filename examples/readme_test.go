// Package examples_test checks that the README's Go snippets are code that compiles and runs.
package examples_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every Go block of the README is a verbatim excerpt, up to indentation, of a runnable example
// (an example_test.go file, whose Example functions go test compiles and runs against the test
// database) or of an example program. A snippet edited in the README alone fails here.
func TestREADMESnippetsAreExcerptsOfCompiledExamples(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(readme), -1)
	if len(blocks) == 0 {
		t.Fatal("the README has no Go block")
	}

	sources := map[string][]string{}
	err = filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		inExamples := strings.HasPrefix(filepath.ToSlash(path), "../examples/") && strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go")
		if d.Type().IsRegular() && (d.Name() == "example_test.go" || inExamples) {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			sources[path] = strings.Split(string(b), "\n")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	for _, b := range blocks {
		snippet := strings.Split(strings.TrimSuffix(b[1], "\n"), "\n")
		found := false
		for _, lines := range sources {
			if excerptOf(snippet, lines) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("this README snippet is in no example_test.go file nor example program; copy it from one:\n%s", b[1])
		}
	}
}

// excerptOf reports whether snippet is a run of lines in lines, each indented by the same prefix.
func excerptOf(snippet, lines []string) bool {
	for i := range lines {
		indent, ok := strings.CutSuffix(lines[i], snippet[0])
		if !ok || strings.TrimLeft(indent, "\t") != "" || i+len(snippet) > len(lines) {
			continue
		}
		match := true
		for k, s := range snippet {
			if l := lines[i+k]; l != indent+s && (s != "" || strings.TrimSpace(l) != "") {
				match = false
				break
			}
		}
		if match {
			return true
		}
	}
	return false
}
