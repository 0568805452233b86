// Package pgtest gives tests a PostgreSQL server: the one named by
// TXBOX_TEST_DATABASE_URL, the local cluster, or a throwaway one started
// for this test binary (see internal/pgserver).
//
// A test that needs PostgreSQL fails, never skips, when none can be had:
// a skipped storage test suite looks green while proving nothing.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txbox/txbox/internal/pgserver"
)

// EnvVar names the server to use instead of discovering one.
const EnvVar = "TXBOX_TEST_DATABASE_URL"

var (
	mu          sync.Mutex
	server      *pgserver.Server
	discoverErr error
	discovered  bool
	mainRunning bool
	warnedLeak  bool
)

// discover is a variable so this package's own tests can force a throwaway
// server on a machine whose local cluster is up.
var discover = pgserver.Discover

// Main runs the tests and then stops a throwaway server this process
// started. Use it as: func TestMain(m *testing.M) { pgtest.Main(m) }
func Main(m *testing.M) {
	mu.Lock()
	mainRunning = true
	mu.Unlock()

	code := m.Run()

	mu.Lock()
	s := server
	mu.Unlock()
	if err := s.Stop(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: stopping throwaway PostgreSQL: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// AdminURL returns a superuser connection string, discovering the server
// once per process. It fails the test with the how-to-fix message when no
// server can be had.
func AdminURL(t testing.TB) string {
	t.Helper()
	url, err := discoverOnce(t)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return url
}

// URL is AdminURL for runnable examples, which have no testing.TB.
func URL() (string, error) {
	return discoverOnce(nil)
}

// discoverOnce discovers the server on the first call; t, when not nil,
// receives the discovery's log lines.
func discoverOnce(t testing.TB) (string, error) {
	mu.Lock()
	defer mu.Unlock()
	if !discovered {
		discovered = true
		// Holding mu while discovering makes other tests wait for the one
		// discovery instead of starting servers of their own.
		//
		// The server keeps logf for Stop, which Main calls after every test
		// has ended, when t.Logf would panic; so t only while discovering.
		var logTo testing.TB = t
		logf := func(format string, args ...any) {
			if logTo != nil {
				logTo.Logf(format, args...)
			} else {
				fmt.Fprintf(os.Stderr, format+"\n", args...)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		server, discoverErr = discover(ctx, EnvVar, logf)
		cancel()
		logTo = nil
	}
	if discoverErr != nil {
		return "", discoverErr
	}
	if server.Throwaway && !mainRunning && !warnedLeak {
		warnedLeak = true
		fmt.Fprintf(os.Stderr, "pgtest: this package's TestMain does not call pgtest.Main, so the throwaway server at %s will be left running\n", server.URL)
	}
	return server.URL, nil
}

// NewDatabase creates an empty database for this test alone, drops it when
// the test ends, and returns its connection string. For tests that need a
// whole database: several processes, LISTEN/NOTIFY, restarts.
func NewDatabase(t testing.TB) string {
	t.Helper()
	AdminURL(t) // discovers the server with t's log, or fails the test
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dbURL, drop, err := CreateDatabase(ctx)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if err := drop(); err != nil {
			t.Errorf("pgtest: %v", err)
		}
	})
	return dbURL
}

// ThroughPgBouncer starts a PgBouncer in transaction pooling mode for this test in front of the
// test server (see pgserver.StartPgBouncer: every transaction may get another server connection,
// with no session state left over) and returns dbURL, a connection string to that server, routed
// through it. It fails the test, saying how to install pgbouncer, when the machine lacks it.
func ThroughPgBouncer(t testing.TB, dbURL string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b, err := pgserver.StartPgBouncer(ctx, AdminURL(t), t.Logf)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Stop(); err != nil {
			t.Errorf("pgtest: %v", err)
		}
	})
	return b.URLFor(dbURL)
}

// CreateDatabase is NewDatabase for callers without a testing.TB (runnable
// examples): it returns the new database's connection string and a function
// that drops it.
func CreateDatabase(ctx context.Context) (dbURL string, drop func() error, err error) {
	admin, err := discoverOnce(nil)
	if err != nil {
		return "", nil, err
	}
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	name := "txbox_test_" + hex.EncodeToString(b[:])
	ident := pgx.Identifier{name}.Sanitize()
	if dbURL, err = withDatabase(admin, name); err != nil {
		return "", nil, err
	}
	if err := execAdmin(ctx, admin, "CREATE DATABASE "+ident); err != nil {
		return "", nil, fmt.Errorf("create database %s: %w", name, err)
	}
	return dbURL, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		// FORCE: a test that leaked a connection must not leak the database.
		if err := execAdmin(ctx, admin, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)"); err != nil {
			return fmt.Errorf("drop database %s: %w", name, err)
		}
		return nil
	}, nil
}

// execAdmin runs one statement on the admin connection, retrying while
// another session holds the template database: CREATE DATABASE fails with
// object_in_use then, which happens when test binaries run in parallel.
func execAdmin(ctx context.Context, admin, sql string) error {
	for {
		err := execOnce(ctx, admin, sql)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55006" {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (gave up: %v)", err, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func execOnce(ctx context.Context, connString, sql string) error {
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql)
	return err
}

// withDatabase points connString at database name. The admin string may be
// a URL or, when it comes from the environment, keyword/value form.
func withDatabase(connString, name string) (string, error) {
	if strings.HasPrefix(connString, "postgres://") || strings.HasPrefix(connString, "postgresql://") {
		u, err := url.Parse(connString)
		if err != nil {
			return "", fmt.Errorf("parse %s: %w", EnvVar, err)
		}
		u.Path = "/" + name
		u.RawPath = ""
		return u.String(), nil
	}
	// pgconn lets a later keyword override an earlier one.
	return connString + " dbname=" + name, nil
}
