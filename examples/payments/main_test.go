package main

import (
	"bytes"
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/pgtest"
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
