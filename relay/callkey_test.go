package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/stripetest"
)

// The replay window belongs to the idempotency key, not to the outbox row: Stripe forgets a key a
// day after it first saw it, whichever call sent it. A second call written with an explicit key
// that an earlier call used more than the window ago must not be sent (Stripe would execute it
// again); it goes to the DLQ for a person.
func TestCallReplayWindowIsPerIdempotencyKey(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	clock := stripetest.NewManualClock(time.Now())
	s := stripetest.New(stripetest.Options{KeyTTL: 24 * time.Hour, Now: clock.Now})
	t.Cleanup(s.Close)
	b := &callBundle{env: env, writer: w, stripe: s, sink: &memSink{}}
	b.startCallRelay(t, nil)

	key := "pay-explicit-key"
	b.enqueue(t, chargeCall(key, 1000))
	b.waitResult(t, key)
	require.Equal(t, 1, s.ChargesFor(key))

	// A day and an hour pass, on both clocks: Stripe forgets the key.
	clock.Advance(25 * time.Hour)
	_, err = env.Pool.Exec(context.Background(), `UPDATE `+env.Q("txbox_call_result")+`
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
