package main

import (
	"bytes"
	"context"
	"log/slog"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/internal/txtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The example's own reconciliation, with every fault injected, must come out clean: no payment
// charged twice, none pending, every reply applied once.
func TestReconciliation(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	var out bytes.Buffer
	rep, err := run(context.Background(), options{
		DatabaseURL: env.URL, Schema: env.Schema, Brokers: kafkatest.Brokers(t),
		Payments: 30, Timeout: 2 * time.Minute,
		Log: slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Out: &out,
	})
	t.Log("\n" + out.String())
	require.NoError(t, err)

	require.Zero(t, rep.DoubleCharges, "double charges")
	require.Zero(t, rep.Pending, "still pending")
	require.Zero(t, rep.Unaccounted, "payments without a row")
	require.Zero(t, rep.RepliesAppliedTwice, "replies applied twice")
	require.Zero(t, rep.DeadLetters)
	require.True(t, rep.ok())

	// The faults really happened, or the clean result proves nothing.
	require.Equal(t, 30, rep.Payments)
	require.Equal(t, 30+30/duplicateEvery, rep.Deliveries)
	require.GreaterOrEqual(t, rep.DuplicatesSuppressed, 30/duplicateEvery, "duplicate deliveries reached the inbox")
	require.Equal(t, 30/consumerCrashEvery, rep.ConsumerCrashes)
	require.Equal(t, maxLostResponses, rep.LostResponses)
	require.Contains(t, rep.RelayCrash, "relay-a", "relay-a crashed mid-call")
	require.Equal(t, 30/declineEvery, rep.Declined)
	require.Equal(t, 30-30/declineEvery, rep.ChargesCreated)
	require.Greater(t, rep.StripeRequests, 30, "retries reached Stripe")
	require.Contains(t, out.String(), "double charges")
}

type testLog struct{ t *testing.T }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}

// -external-relays prints the lines to start relays in other terminals. Pasted into a shell (with
// the test's txbox binary for `go run ./cmd/txbox`) they run relays that settle every payment,
// even when one of them is killed with SIGKILL mid-run; and the database password is printed
// nowhere, nor passed on any command line.
func TestExternalRelays(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	const password = "s3cret-pw" // the test server trusts local connections and never asks for it
	dsn, err := url.Parse(env.URL)
	require.NoError(t, err)
	dsn.User = url.UserPassword(dsn.User.Username(), password)

	out := &proctest.Buffer{}
	type result struct {
		rep report
		err error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := run(context.Background(), options{
			DatabaseURL: dsn.String(), Schema: env.Schema, Brokers: kafkatest.Brokers(t),
			Payments: 12, ExternalRelays: true, Timeout: 2 * time.Minute,
			Log: slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
			Out: out,
		})
		done <- result{rep, err}
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "Waiting up to") }, time.Minute, 10*time.Millisecond,
		"the command lines are printed:\n%s", out.String())

	var exports, commands []string
	for line := range strings.Lines(strings.ReplaceAll(out.String(), "\\\n", "")) {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "export "):
			exports = append(exports, line)
		case strings.HasPrefix(line, "go run ./cmd/txbox relay "):
			commands = append(commands, strings.Replace(line, "go run ./cmd/txbox", proctest.Binary(t), 1))
		}
	}
	require.Len(t, commands, 2, out.String())
	require.Contains(t, exports, "export TXBOX_DATABASE_URL="+shellQuote(env.URL), "the URL, without the password")
	var relays []*proctest.Proc
	for _, c := range commands {
		require.NotContains(t, c, "--database-url")
		relays = append(relays, proctest.StartProgram(t, "/bin/sh", nil, "-c", strings.Join(exports, "\n")+"\nexec "+c))
	}

	// Once some payments are settled, kill one relay; the other takes its shards over.
	require.Eventually(t, func() bool {
		var settled int
		err := env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+env.Q("charges")+" WHERE status <> 'pending'").Scan(&settled)
		return err == nil && settled > 0
	}, time.Minute, 10*time.Millisecond)
	relays[0].Signal(syscall.SIGKILL)

	var r result
	select {
	case r = <-done:
	case <-time.After(3 * time.Minute):
		t.Fatalf("the example did not finish:\n%s", out.String())
	}
	t.Log("\n" + out.String())
	require.NoError(t, r.err)
	require.True(t, r.rep.ok(), "reconciliation")
	require.Equal(t, 12, r.rep.Payments)
	require.Zero(t, r.rep.DoubleCharges)
	require.NotContains(t, out.String(), password)
	for _, p := range relays {
		require.NotContains(t, p.Output(), password)
	}
}

func TestWithoutPassword(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		in, want string
		had      bool
	}{
		{"postgres://app:pw@db:5432/shop?sslmode=disable", "postgres://app@db:5432/shop?sslmode=disable", true},
		{"postgresql://app@db/shop", "postgresql://app@db/shop", false},
		{"postgres://db/shop?password=pw&sslmode=require", "postgres://db/shop?sslmode=require", true},
		{"host=db user=app password=pw dbname=shop", "host=db user=app dbname=shop", true},
		{"host=db password='p w\\'x' dbname=shop", "host=db dbname=shop", true},
		{"password=pw host=db", "host=db", true},
		{"host=db user=app", "host=db user=app", false},
	} {
		got, had := withoutPassword(c.in)
		require.Equal(t, c.want, got, c.in)
		require.Equal(t, c.had, had, c.in)
	}
}
