// Package pgserver finds a PostgreSQL server to run against: one named by an
// environment variable, the machine's local cluster, or, failing both, a
// throwaway server started from the machine's PostgreSQL binaries.
//
// It is shared by tests and example programs, so it must not import testing.
package pgserver

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// DefaultURL is the local cluster that Debian's postgresql package sets up
// (trust auth for postgres on 127.0.0.1), tried when no variable is set.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// ErrNoServer is wrapped by Discover's error when no server could be had, so
// callers can tell "nothing to run against" from other failures.
var ErrNoServer = errors.New("pgserver: no PostgreSQL server available")

const (
	// Short for the default URL: a missing local cluster usually refuses at
	// once, and a hung one should not delay the fallback for long.
	defaultPingTimeout = 2 * time.Second
	// Longer for a URL the user named explicitly: it may be remote or busy,
	// and there is no fallback to move on to.
	envPingTimeout = 10 * time.Second
)

// Server is a reachable PostgreSQL server. URL connects as a superuser (or,
// for a server named by the environment, as whoever the user chose).
type Server struct {
	URL string
	// Throwaway is true when this process started the server; Stop then
	// shuts it down and deletes its files.
	Throwaway bool

	dir     string // temp dir holding data/, the log and the unix socket
	port    int    // a throwaway's
	binDir  string
	runAs   *runAsUser
	logf    func(format string, args ...any)
	stopMu  sync.Mutex
	stopped bool
	stopErr error
}

// Discover returns a server to connect to. envVar, if set in the
// environment, must answer (an error names the variable otherwise); else
// DefaultURL is tried; else a throwaway server is started.
//
// logf may be nil. The Server keeps it for Stop, so it must still be usable
// when Stop runs (a testing.T's Logf is not, once that test has ended).
func Discover(ctx context.Context, envVar string, logf func(format string, args ...any)) (*Server, error) {
	return discover(ctx, envVar, logf, DefaultURL, StartThrowaway)
}

// discover takes the default URL and the fallback as arguments so tests can
// reach the "nothing available" path on a machine that has everything.
func discover(ctx context.Context, envVar string, logf func(format string, args ...any),
	defaultURL string, startThrowaway func(context.Context, func(string, ...any)) (*Server, error),
) (*Server, error) {
	logf = orNop(logf)

	if envVar != "" {
		if v := os.Getenv(envVar); v != "" {
			if err := Ping(ctx, v, envPingTimeout); err != nil {
				return nil, fmt.Errorf("pgserver: %s=%s does not answer: %w (fix or unset %s)",
					envVar, redact(v), err, envVar)
			}
			logf("pgserver: using %s=%s", envVar, redact(v))
			return &Server{URL: v, logf: logf}, nil
		}
	}

	defErr := Ping(ctx, defaultURL, defaultPingTimeout)
	if defErr == nil {
		logf("pgserver: using local cluster %s", defaultURL)
		return &Server{URL: defaultURL, logf: logf}, nil
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	logf("pgserver: local cluster %s does not answer (%v); starting a throwaway server", defaultURL, defErr)

	s, err := startThrowaway(ctx, logf)
	if err != nil {
		return nil, fmt.Errorf("%w.\n%s\nWhat was tried:\n  - %s: %v\n  - throwaway server: %v",
			ErrNoServer, howTo(envVar), defaultURL, defErr, err)
	}
	return s, nil
}

// Stop shuts down and deletes a throwaway server; for any other server it
// does nothing. It is safe to call more than once.
func (s *Server) Stop() error {
	if s == nil || !s.Throwaway {
		return nil
	}
	s.stopMu.Lock()
	defer s.stopMu.Unlock()
	if !s.stopped {
		s.stopped = true
		s.stopErr = s.stopThrowaway()
	}
	return s.stopErr
}

// Ping connects to connString and runs a trivial round trip, giving up
// after timeout.
func Ping(ctx context.Context, connString string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, connString)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.Ping(ctx)
}

// howTo is the part of the error a person reads to fix their machine, so it
// names concrete commands rather than describing the search.
func howTo(envVar string) string {
	var b strings.Builder
	b.WriteString("Provide one in any of these ways:\n")
	n := 1
	if envVar != "" {
		fmt.Fprintf(&b, "  %d. set %s to a server where the user may CREATE DATABASE, e.g.\n"+
			"       export %s='postgres://USER:PASSWORD@HOST:5432/postgres?sslmode=disable'\n", n, envVar, envVar)
		n++
	}
	ver := clusterVersion()
	fmt.Fprintf(&b, "  %d. start the local cluster so %s answers:\n"+
		"       pg_ctlcluster --skip-systemctl-redirect %s main start   (pg_lsclusters lists clusters)\n", n, DefaultURL, ver)
	n++
	fmt.Fprintf(&b, "  %d. install PostgreSQL server binaries (initdb, pg_ctl, postgres) so a throwaway server can be started:\n"+
		"       apt-get install -y postgresql   (or put their directory on PATH)", n)
	return b.String()
}

// redact hides a password so errors and logs can be shared safely.
func redact(connString string) string {
	u, err := url.Parse(connString)
	if err != nil || u.Scheme == "" || u.User == nil {
		if strings.Contains(connString, "password") {
			return "(connection string with password, not shown)"
		}
		return connString
	}
	if _, has := u.User.Password(); has {
		u.User = url.UserPassword(u.User.Username(), "xxxxx")
	}
	return u.String()
}

func orNop(logf func(string, ...any)) func(string, ...any) {
	if logf == nil {
		return func(string, ...any) {}
	}
	return logf
}
