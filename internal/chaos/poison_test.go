package chaos_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/chaos"
	"github.com/txbox/txbox/internal/txtest"
)

// A message that kills the consumer process every time it is handled (a poison pill) is
// dead-lettered once its attempts are used up: the consumer, restarted after each death as a
// supervisor would, dies exactly MaxAttempts times, then goes on, and every other message —
// including the later ones of the poison's own key — is applied exactly once, in key order.
func TestPoisonMessageCrashingTheConsumerIsDeadLettered(t *testing.T) {
	t.Parallel()
	const maxAttempts = 3
	b := newBundle(t, txtest.New(t))
	ctx := context.Background()

	var poison string
	for i := range 8 {
		for k := range 4 {
			m := keyed(watermill.NewUUID(), fmt.Sprintf("key-%d", k), fmt.Sprintf(`{"n":%d}`, i))
			if k == 1 && i == 2 {
				m.Payload, poison = []byte("poison"), m.UUID
			}
			require.NoError(t, b.write(ctx, []*message.Message{m}, true, 0))
		}
	}
	b.startRelay(t, b.env.Pool)
	consumer := supervise(t, "consumer", consumerBinary(t),
		b.consumerArgs(t, "billing", "--max-attempts", fmt.Sprint(maxAttempts)), nil, nil)

	dead := "SELECT count(*) FROM " + b.env.Q("txbox_dlq")
	require.Eventually(t, func() bool { return count(ctx, b.env.Pool, dead) == 1 }, 2*time.Minute, 50*time.Millisecond,
		"the poison message reaches the dead-letter table")
	o := b.outcome(t, []string{"billing"})
	require.Equal(t, 32, len(o.Committed))
	require.Equal(t, 1, count(ctx, b.env.Pool, dead+" WHERE source = 'inbox' AND consumer = 'billing' AND uuid = $1 AND reason = $2 AND attempts = $3",
		poison, inbox.ReasonAttemptsExhausted, maxAttempts), "dead letter of the poison: %+v", o.DeadLetters)

	require.Eventually(t, func() bool {
		return count(ctx, b.env.Pool, "SELECT count(DISTINCT uuid) FROM "+b.env.Q("effects")) == len(o.Committed)-1
	}, time.Minute, 50*time.Millisecond, "the consumer goes on with the other messages")
	consumer.stop(20 * time.Second)

	stats := consumer.snapshot()
	t.Logf("consumer: %s", stats)
	require.Empty(t, stats.unexpected)
	require.Equal(t, maxAttempts, stats.crashes, "the consumer died once per attempt, then never again")

	// The poison is dead and was never applied; everything else keeps the invariants.
	o = b.outcome(t, []string{"billing"})
	o.Committed = slices.DeleteFunc(o.Committed, func(m chaos.Message) bool { return m.UUID == poison })
	o.DeadLetters = slices.DeleteFunc(o.DeadLetters, func(d chaos.DeadLetter) bool { return d.UUID == poison })
	require.False(t, slices.ContainsFunc(o.Effects, func(e chaos.Effect) bool { return e.UUID == poison }))
	requireNoViolations(t, o)
}
