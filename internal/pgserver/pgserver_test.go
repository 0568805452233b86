package pgserver

// Plain testing, no testify: testify pulls in a yaml module whose go.sum
// entry this module does not carry, and this package must build regardless.

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Not TXBOX_TEST_DATABASE_URL: a developer's setting of that must not change
// what these tests exercise.
const testEnvVar = "TXBOX_PGSERVER_TEST_URL"

func selectOne(t *testing.T, url string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(ctx, "SELECT 1").Scan(&n); err != nil || n != 1 {
		t.Fatalf("SELECT 1 on %s: got %d, %v", url, n, err)
	}
}

func stopInCleanup(t *testing.T, s *Server) {
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
}

func TestDiscover(t *testing.T) {
	t.Setenv(testEnvVar, "")
	s, err := Discover(context.Background(), testEnvVar, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	stopInCleanup(t, s)
	selectOne(t, s.URL)
	if !s.Throwaway {
		if s.URL != DefaultURL {
			t.Errorf("URL = %q, want %q", s.URL, DefaultURL)
		}
		if err := s.Stop(); err != nil {
			t.Errorf("Stop of an external server: %v", err)
		}
		selectOne(t, s.URL) // Stop must not have touched an external server
	}
}

func TestDiscoverUsesEnvVar(t *testing.T) {
	s, err := Discover(context.Background(), "", nil)
	if err != nil {
		t.Fatal(err)
	}
	stopInCleanup(t, s)

	t.Setenv(testEnvVar, s.URL)
	got, err := Discover(context.Background(), testEnvVar, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	if got.URL != s.URL || got.Throwaway {
		t.Errorf("got %q throwaway=%v, want %q from %s", got.URL, got.Throwaway, s.URL, testEnvVar)
	}
}

func TestDiscoverBadEnvVar(t *testing.T) {
	// Port 1 on loopback refuses at once, so this fails fast.
	t.Setenv(testEnvVar, "postgres://postgres:secret@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	start := time.Now()
	s, err := Discover(context.Background(), testEnvVar, t.Logf)
	if err == nil {
		s.Stop()
		t.Fatalf("Discover with unreachable %s succeeded: %s", testEnvVar, s.URL)
	}
	t.Logf("error: %v", err)
	msg := err.Error()
	if !strings.Contains(msg, testEnvVar) {
		t.Errorf("error does not name %s: %v", testEnvVar, err)
	}
	if strings.Contains(msg, "secret") {
		t.Errorf("error leaks the password: %v", err)
	}
	if errors.Is(err, ErrNoServer) {
		t.Errorf("a bad explicit setting must not look like 'nothing configured'")
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("took %v", d)
	}
}

func TestStartThrowaway(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	start := time.Now()
	s, err := StartThrowaway(ctx, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("throwaway start took %v", time.Since(start))
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = s.Stop()
		}
	})

	if !s.Throwaway || !strings.HasPrefix(s.URL, "postgres://postgres@127.0.0.1:") || s.URL == DefaultURL {
		t.Errorf("unexpected server: %+v", s)
	}
	selectOne(t, s.URL)

	// Tests with several worker processes need more than postgres' default
	// 100 connections.
	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	var maxConns, fsync string
	if err := conn.QueryRow(ctx, "SELECT current_setting('max_connections'), current_setting('fsync')").Scan(&maxConns, &fsync); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	if maxConns != "300" || fsync != "off" {
		t.Errorf("max_connections=%s fsync=%s, want 300 off", maxConns, fsync)
	}

	// The unix socket must live in the temp dir, not a shared system dir.
	if m, _ := filepath.Glob(filepath.Join(s.dir, ".s.PGSQL.*")); len(m) == 0 {
		t.Errorf("no unix socket in %s", s.dir)
	}

	dir := s.dir
	if _, err := os.Stat(dir); err != nil {
		t.Fatal(err)
	}
	stopStart := time.Now()
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	stopped = true
	t.Logf("throwaway stop took %v", time.Since(stopStart))
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("data dir %s still there after Stop: %v", dir, err)
	}
	if err := Ping(ctx, s.URL, 2*time.Second); err == nil {
		t.Errorf("server still answers after Stop")
	}
	if err := s.Stop(); err != nil {
		t.Errorf("second Stop: %v", err)
	}
}

// Several test binaries start throwaways at once under go test ./...; they
// must not collide on ports, sockets or dirs.
func TestStartThrowawayConcurrently(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	type result struct {
		s   *Server
		err error
	}
	ch := make(chan result, 2)
	for range cap(ch) {
		go func() {
			s, err := StartThrowaway(ctx, t.Logf)
			ch <- result{s, err}
		}()
	}
	seen := map[string]bool{}
	for range cap(ch) {
		r := <-ch
		if r.err != nil {
			t.Error(r.err)
			continue
		}
		stopInCleanup(t, r.s)
		selectOne(t, r.s.URL)
		if seen[r.s.URL] {
			t.Errorf("two servers with URL %s", r.s.URL)
		}
		seen[r.s.URL] = true
	}
}

func TestVersionLess(t *testing.T) {
	for _, c := range []struct {
		a, b string
		want bool
	}{{"9.6", "10", true}, {"15", "17", true}, {"17", "9.6", false}, {"15", "15", false}} {
		if got := versionLess(c.a, c.b); got != c.want {
			t.Errorf("versionLess(%q, %q) = %v", c.a, c.b, got)
		}
	}
}

func TestRedact(t *testing.T) {
	if got := redact("postgres://u:pw@h:5432/db"); got != "postgres://u:xxxxx@h:5432/db" {
		t.Errorf("redact = %q", got)
	}
	if got := redact(DefaultURL); got != DefaultURL {
		t.Errorf("redact changed a URL without password: %q", got)
	}
	if got := redact("host=h password=pw"); strings.Contains(got, "pw") {
		t.Errorf("redact = %q", got)
	}
}

func TestHowToNamesEveryRemedy(t *testing.T) {
	msg := howTo("SOME_VAR")
	for _, want := range []string{"SOME_VAR", "pg_ctlcluster --skip-systemctl-redirect", "apt-get install"} {
		if !strings.Contains(msg, want) {
			t.Errorf("how-to lacks %q:\n%s", want, msg)
		}
	}
	t.Logf("\n%s", msg)
}

// Nothing listens on loopback port 1, so this stands in for a machine whose
// local cluster is down.
const deadURL = "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable"

func TestDiscoverFallsBackToThrowaway(t *testing.T) {
	t.Setenv(testEnvVar, "")
	s, err := discover(context.Background(), testEnvVar, t.Logf, deadURL, StartThrowaway)
	if err != nil {
		t.Fatal(err)
	}
	stopInCleanup(t, s)
	if !s.Throwaway {
		t.Errorf("expected a throwaway server, got %+v", s)
	}
	selectOne(t, s.URL)
}

func TestDiscoverNothingAvailable(t *testing.T) {
	t.Setenv(testEnvVar, "")
	noBinaries := func(context.Context, func(string, ...any)) (*Server, error) {
		return nil, errors.New("no binaries here")
	}
	_, err := discover(context.Background(), testEnvVar, t.Logf, deadURL, noBinaries)
	if !errors.Is(err, ErrNoServer) {
		t.Fatalf("err = %v, want ErrNoServer", err)
	}
	for _, want := range []string{testEnvVar, "pg_ctlcluster", "apt-get install", "no binaries here", "127.0.0.1:1"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	t.Logf("\n%v", err)
}

// The kill fallback must take the server down on its own, and Stop must
// still clean up after a server that already died.
func TestKillPostmasterThenStop(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := StartThrowaway(ctx, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	stopInCleanup(t, s)
	if err := s.killPostmaster(); err != nil {
		t.Fatal(err)
	}
	if err := Ping(ctx, s.URL, 2*time.Second); err == nil {
		t.Fatal("server still answers after killPostmaster")
	}
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("dir %s still there: %v", s.dir, err)
	}
}
