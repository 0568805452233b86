package relay_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/retention"
	"github.com/txbox/txbox/stripetest"
)

// startForgetfulCallRelay runs a call relay against a Stripe double that forgets keys after 24 h
// of the clock it returns.
func startForgetfulCallRelay(t *testing.T) (*callBundle, *stripetest.ManualClock, *callRelay) {
	t.Helper()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	clock := stripetest.NewManualClock(time.Now())
	s := stripetest.New(stripetest.Options{KeyTTL: 24 * time.Hour, Now: clock.Now})
	t.Cleanup(s.Close)
	b := &callBundle{env: env, writer: w, stripe: s, sink: &memSink{}}
	return b, clock, b.startCallRelay(t, nil)
}

// The replay window belongs to the idempotency key, not to the outbox row: Stripe forgets a key a
// day after it first saw it, whichever call sent it. A second call written with an explicit key
// that an earlier call used more than the window ago must not be sent (Stripe would execute it
// again); it goes to the DLQ for a person.
func TestCallReplayWindowIsPerIdempotencyKey(t *testing.T) {
	t.Parallel()
	b, clock, _ := startForgetfulCallRelay(t)
	env, s := b.env, b.stripe

	key := "pay-explicit-key"
	b.enqueue(t, chargeCall(key, 1000))
	b.waitResult(t, key)
	require.Equal(t, 1, s.ChargesFor(key))

	// A day and an hour pass, on both clocks: Stripe forgets the key.
	clock.Advance(25 * time.Hour)
	_, err := env.Pool.Exec(context.Background(), `UPDATE `+env.Q("txbox_call_result")+`
		SET completed_at = completed_at - interval '25 hours', first_attempt_at = first_attempt_at - interval '25 hours'
		WHERE idempotency_key = $1`, key)
	require.NoError(t, err)

	b.enqueue(t, chargeCall(key, 1000))
	d := b.waitDead(t, key)
	require.Equal(t, relay.ReasonCallTooOld, d.reason)
	require.Contains(t, d.errText, key)
	require.Equal(t, 1, s.RequestsFor(key), "the second call was never sent")
	require.Equal(t, 1, s.ChargesFor(key), "one charge")
	require.Zero(t, b.pendingCalls(t))
}

// A call buried after it reached the provider still started its key's day there: a call written
// again with that key more than the window later is not sent, though the first is in the DLQ and
// no longer in the outbox or the results. A letter of a call that was never sent (no attempts)
// started nothing, and its key's next call is executed.
func TestCallReplayWindowCountsDeadLetteredCalls(t *testing.T) {
	t.Parallel()
	b, clock, _ := startForgetfulCallRelay(t)
	env, s := b.env, b.stripe
	ctx := context.Background()

	sent, neverSent := "pay-buried-after-sending", "pay-buried-unsent"
	s.Inject(stripetest.Fault{Kind: stripetest.Fault500Stored, Key: sent})
	b.enqueue(t, chargeCall(sent, 1000))
	require.Equal(t, relay.ReasonCallIndeterminate, b.waitDead(t, sent).reason)
	require.Equal(t, 1, s.RequestsFor(sent))
	// What the relay writes for a call it could not decode, before any attempt.
	dead, err := dlq.NewWriter(env.Schema)
	require.NoError(t, err)
	err = pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
		return dead.Add(ctx, tx, dlq.Entry{Source: dlq.SourceRelay, Kind: "call", UUID: "unsent", IdempotencyKey: neverSent,
			Reason: relay.ReasonInvalidCall, Error: "undecodable call payload"})
	})
	require.NoError(t, err)

	// A day and an hour pass, on both clocks: Stripe forgets the keys.
	clock.Advance(25 * time.Hour)
	_, err = env.Pool.Exec(ctx, `UPDATE `+env.Q("txbox_dlq")+` SET first_failed_at = first_failed_at - interval '25 hours'`)
	require.NoError(t, err)

	b.enqueue(t, chargeCall(sent, 1000))
	b.enqueue(t, chargeCall(neverSent, 1000))
	b.waitResult(t, neverSent)
	require.Equal(t, 1, s.ChargesFor(neverSent), "a key no call sent is young")
	require.Eventually(t, func() bool {
		var tooOld int
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM `+env.Q("txbox_dlq")+`
			WHERE idempotency_key = $1 AND reason = $2`, sent, relay.ReasonCallTooOld).Scan(&tooOld))
		return tooOld == 1
	}, 30*time.Second, 10*time.Millisecond, "the second call of %s dead-lettered as too old", sent)
	require.Equal(t, 1, s.RequestsFor(sent), "the second call was never sent")
	require.Zero(t, b.pendingCalls(t))
}

// Retention keeps the result of a key a pending call has: the relay measures the key's replay
// window from it. Before, a pass deleted it once it was older than CallResultRetention, and a call
// written again with the key of one done more than a day before was sent and executed twice.
func TestRetentionKeepsTheResultOfAKeyAPendingCallHas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b, clock, first := startForgetfulCallRelay(t)
	env, s := b.env, b.stripe
	key := "pay-explicit-key"
	b.enqueue(t, chargeCall(key, 1000))
	b.waitResult(t, key)
	require.NoError(t, first.stop())

	clock.Advance(25 * time.Hour)
	_, err := env.Pool.Exec(ctx, `UPDATE `+env.Q("txbox_call_result")+`
		SET completed_at = completed_at - interval '25 hours', first_attempt_at = first_attempt_at - interval '25 hours'
		WHERE idempotency_key = $1`, key)
	require.NoError(t, err)
	b.enqueue(t, chargeCall(key, 1000))
	c, err := retention.New(retention.Config{DB: env.Pool, Schema: env.Schema, BrokerRetention: 7 * 24 * time.Hour,
		CallResultRetention: retention.MinCallResultRetention, Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	require.NoError(t, err)
	rep, err := c.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.CallResultsDeleted)

	b.startCallRelay(t, nil)
	require.Eventually(t, func() bool { return b.pendingCalls(t) == 0 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, s.RequestsFor(key), "the second call was never sent: its key was first sent 25 h ago")
	require.Equal(t, 1, s.ChargesFor(key))
	require.Equal(t, relay.ReasonCallTooOld, b.waitDead(t, key).reason)
}
