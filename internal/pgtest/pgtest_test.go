package pgtest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/internal/pgserver"
)

// childEnv makes this test binary act as a child of TestMainStopsThrowaway:
// its value is what the child's test should do.
const childEnv = "TXBOX_PGTEST_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode == "pass" || mode == "fail" {
		discover = func(ctx context.Context, _ string, logf func(string, ...any)) (*pgserver.Server, error) {
			return pgserver.StartThrowaway(ctx, logf)
		}
	}
	Main(m)
}

func TestChild(t *testing.T) {
	mode := os.Getenv(childEnv)
	if mode == "" {
		return // only meaningful when run by TestMainStopsThrowaway or TestAKilledTestLeavesNoPgBouncer
	}
	if mode == "pgbouncer" {
		fmt.Printf("CHILD_URL=%s\n", ThroughPgBouncer(t, AdminURL(t)))
		time.Sleep(time.Minute) // killed by the parent long before
		return
	}
	fmt.Printf("CHILD_URL=%s\n", NewDatabase(t))
	if mode == "fail" {
		t.Error("failing on purpose")
	}
}

// Main must stop the throwaway server after the tests, whether they passed
// or failed, and keep the exit status.
func TestMainStopsThrowaway(t *testing.T) {
	for _, mode := range []string{"pass", "fail"} {
		t.Run(mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestChild$", "-test.v")
			cmd.Env = append(os.Environ(), childEnv+"="+mode)
			out, err := cmd.CombinedOutput()
			var exitErr *exec.ExitError
			switch {
			case mode == "pass" && err != nil:
				t.Fatalf("child failed: %v\n%s", err, out)
			case mode == "fail" && !(errors.As(err, &exitErr) && exitErr.ExitCode() == 1):
				t.Fatalf("child exit = %v, want status 1\n%s", err, out)
			}
			m := regexp.MustCompile(`CHILD_URL=(\S+)`).FindSubmatch(out)
			if m == nil {
				t.Fatalf("child printed no URL:\n%s", out)
			}
			url := string(m[1])
			if !strings.Contains(string(out), "started throwaway") {
				t.Fatalf("child did not use a throwaway server:\n%s", out)
			}
			if err := pgserver.Ping(context.Background(), url, 2*time.Second); err == nil {
				t.Errorf("throwaway server %s still answers after the child exited", url)
			}
		})
	}
}

// Through the PgBouncer, a transaction finds nothing an earlier one set on its session.
func TestThroughPgBouncerLeavesNoSessionState(t *testing.T) {
	url := ThroughPgBouncer(t, NewDatabase(t))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, `SET search_path TO pg_catalog`); err != nil {
		t.Fatal(err)
	}
	var path string
	if err := conn.QueryRow(ctx, `SHOW search_path`).Scan(&path); err != nil {
		t.Fatal(err)
	}
	if path == "pg_catalog" {
		t.Fatalf("search_path %q survived its transaction: this is not a transaction pooler that resets sessions", path)
	}
}

// A test binary killed outright runs no cleanup; its PgBouncer must go with it all the same.
func TestAKilledTestLeavesNoPgBouncer(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestChild$", "-test.v")
	cmd.Env = append(os.Environ(), childEnv+"=pgbouncer")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var url string
	lines := bufio.NewScanner(out)
	for url == "" && lines.Scan() {
		if u, ok := strings.CutPrefix(lines.Text(), "CHILD_URL="); ok {
			url = u
		}
	}
	if url == "" {
		t.Fatalf("child printed no URL (%v)", lines.Err())
	}
	if err := pgserver.Ping(context.Background(), url, 5*time.Second); err != nil {
		t.Fatalf("the child's PgBouncer does not answer: %v", err)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for pgserver.Ping(context.Background(), url, time.Second) == nil {
		if time.Now().After(deadline) {
			t.Fatalf("the PgBouncer at %s still answers 10 s after its test binary was killed", url)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestAdminURLIsStable(t *testing.T) {
	a, b := AdminURL(t), AdminURL(t)
	if a == "" || a != b {
		t.Fatalf("AdminURL = %q then %q", a, b)
	}
	var super bool
	query(t, a, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user", &super)
	if !super {
		t.Errorf("AdminURL does not connect as a superuser")
	}
}

func TestNewDatabase(t *testing.T) {
	var name string
	t.Run("inner", func(t *testing.T) {
		dbURL := NewDatabase(t)
		query(t, dbURL, "SELECT current_database()", &name)
		if !strings.HasPrefix(name, "txbox_test_") {
			t.Errorf("database %q", name)
		}
		// A connection left open must not stop the cleanup from dropping
		// the database.
		conn, err := pgx.Connect(context.Background(), dbURL)
		if err != nil {
			t.Fatal(err)
		}
		_ = conn
	})
	var exists bool
	query(t, AdminURL(t), "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", &exists, name)
	if exists {
		t.Errorf("database %s still exists after its test ended", name)
	}
}

func TestNewDatabaseParallel(t *testing.T) {
	names := make(chan string, 8)
	t.Run("group", func(t *testing.T) {
		for range cap(names) {
			t.Run("db", func(t *testing.T) {
				t.Parallel()
				var name string
				query(t, NewDatabase(t), "SELECT current_database()", &name)
				names <- name
			})
		}
	})
	close(names)
	seen := map[string]bool{}
	for n := range names {
		if seen[n] {
			t.Errorf("database %s handed out twice", n)
		}
		seen[n] = true
	}
}

func TestWithDatabase(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://u:p@h:5432/postgres?sslmode=disable": "postgres://u:p@h:5432/x?sslmode=disable",
		"postgresql://h/":        "postgresql://h/x",
		"host=h dbname=postgres": "host=h dbname=postgres dbname=x",
	} {
		got, err := withDatabase(in, "x")
		if err != nil || got != want {
			t.Errorf("withDatabase(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

func query(t *testing.T, url, sql string, dst any, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if err := conn.QueryRow(ctx, sql, args...).Scan(dst); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}
