package depgraph_test

import (
	"database/sql"
	"go/ast"
	"go/parser"
	"go/token"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	// This test binary imports the two libraries a service links (and the standard library, which
	// registers no database/sql driver), so sql.Drivers below is what importing them registers.
	_ "github.com/txbox/txbox/inbox"
	_ "github.com/txbox/txbox/outbox"
)

const module = "github.com/txbox/txbox"

// Packages a service that only writes (outbox) and consumes (inbox) must never link: Kafka clients
// belong to the program that builds a subscriber (kafkasub) or runs the relay, and database/sql
// drivers to the program that runs migrations.
var forbidden = []struct{ prefix, why string }{
	{"github.com/IBM/sarama", "a Kafka client"},
	{"github.com/Shopify/sarama", "a Kafka client"},
	{"github.com/ThreeDotsLabs/watermill-kafka", "a Kafka client"},
	{"github.com/twmb/franz-go", "a Kafka client"},
	{"github.com/segmentio/kafka-go", "a Kafka client"},
	{"github.com/confluentinc/confluent-kafka-go", "a Kafka client"},
	{"github.com/jackc/pgx/v5/stdlib", "a database/sql driver"},
	{"github.com/lib/pq", "a database/sql driver"},
	{"github.com/go-sql-driver/mysql", "a database/sql driver"},
	{"github.com/mattn/go-sqlite3", "a database/sql driver"},
	{"modernc.org/sqlite", "a database/sql driver"},
}

// goList runs `go list` with args and returns its output lines.
func goList(t *testing.T, args ...string) []string {
	t.Helper()
	out, err := exec.Command("go", append([]string{"list"}, args...)...).Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("go list %v: %v\n%s", args, err, stderr)
	}
	return strings.Fields(string(out))
}

// deps lists the packages outside the standard library that pkgs import, directly or not.
func deps(t *testing.T, pkgs ...string) []string {
	t.Helper()
	return goList(t, append([]string{"-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}"}, pkgs...)...)
}

func TestOutboxAndInboxPullInNoKafkaClientAndNoSQLDriver(t *testing.T) {
	t.Parallel()
	for _, pkg := range []string{module + "/outbox", module + "/inbox"} {
		got := deps(t, pkg)
		t.Logf("%s pulls in %d packages outside the standard library:\n\t%s", pkg, len(got), strings.Join(got, "\n\t"))
		for _, dep := range got {
			for _, f := range forbidden {
				if dep == f.prefix || strings.HasPrefix(dep, f.prefix+"/") {
					t.Errorf("%s imports %s, %s", pkg, dep, f.why)
				}
			}
		}
	}
	if drivers := sql.Drivers(); len(drivers) > 0 {
		t.Errorf("importing the outbox and the inbox registers database/sql drivers %v", drivers)
	}
}

// The relay publishes what the outbox wrote; it has no business with the consumer side.
func TestRelayDoesNotImportTheInbox(t *testing.T) {
	t.Parallel()
	if slices.Contains(deps(t, module+"/relay"), module+"/inbox") {
		t.Errorf("%s/relay imports %s/inbox", module, module)
	}
}

// scripts/test runs `go test ./...` without build tags: a test file that needs one would silently
// not run. Only the failpoint actions (internal/failpoint/armed.go) are built with a tag, by the
// test harness that builds processes to kill.
func TestEveryTestFileIsBuiltByGoTest(t *testing.T) {
	t.Parallel()
	for _, line := range goList(t, "-f", `{{$d := .Dir}}{{range .IgnoredGoFiles}}{{$d}}/{{.}} {{end}}`, module+"/...") {
		if strings.HasSuffix(line, "_test.go") {
			t.Errorf("%s is left out of the default build: its tests never run", line)
		}
	}
}

// The examples are programs users copy: everything they import must be importable from another
// module. (Their tests may use the internal harnesses.)
func TestExamplesImportNoInternalPackage(t *testing.T) {
	t.Parallel()
	for _, line := range goList(t, "-f", `{{$p := .ImportPath}}{{range .Imports}}{{$p}}:{{.}} {{end}}`, module+"/examples/...") {
		pkg, imp, _ := strings.Cut(line, ":")
		if strings.HasPrefix(imp, module+"/internal/") {
			t.Errorf("%s imports %s, which users cannot import", pkg, imp)
		}
	}
}

// Failpoint hooks may stay in production builds (internal/failpoint explains why) only as long as
// no code but tests attaches one: check every non-test Go file of the module, whatever its build
// tags.
func TestOnlyTestsAttachFailpointHooks(t *testing.T) {
	t.Parallel()
	const failpoint = module + "/internal/failpoint"
	lines := goList(t, "-f", `{{$d := .Dir}}{{range .GoFiles}}{{$d}}/{{.}} {{end}}{{range .IgnoredGoFiles}}{{$d}}/{{.}} {{end}}`, module+"/...")
	if len(lines) == 0 {
		t.Fatal("go list found no Go files")
	}
	fset := token.NewFileSet()
	for _, file := range lines {
		if strings.HasSuffix(filepath.Dir(file), filepath.FromSlash("/internal/failpoint")) {
			continue // the package itself
		}
		f, err := parser.ParseFile(fset, file, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		name := ""
		for _, imp := range f.Imports {
			if path, _ := strconv.Unquote(imp.Path.Value); path == failpoint {
				name = "failpoint"
				if imp.Name != nil {
					name = imp.Name.Name
				}
			}
		}
		if name == "" {
			continue
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if sel, ok := n.(*ast.SelectorExpr); ok && sel.Sel.Name == "WithHook" {
				if x, ok := sel.X.(*ast.Ident); ok && x.Name == name {
					t.Errorf("%s: non-test code attaches a failpoint hook", fset.Position(sel.Pos()))
				}
			}
			return true
		})
	}
}
