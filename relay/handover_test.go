package relay_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/relay"
)

// Shards change hands as soon as a relay joins or stops, not at the relays' next renewal round (every
// LeaseTTL/3, 20 s here): the relays' looks for new rows also see a relay come or go and a lease
// released. A relay joins: the one holding every shard gives up its extra ones and the newcomer
// takes them; it stops gracefully: the other takes its released shards.
func TestShardsChangeHandsWhenARelayJoinsOrStops(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const ttl = time.Minute
	start := func(owner string) (*relay.Relay, context.CancelFunc) {
		sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t), TransactionalIDPrefix: b.env.Schema})
		require.NoError(t, err)
		r, err := relay.New(relay.Config{
			DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Owner: owner, Shards: 4, LeaseTTL: ttl,
			Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		stop := func() {
			cancel()
			require.NoError(t, <-done)
		}
		t.Cleanup(func() {
			if ctx.Err() == nil {
				stop()
			}
		})
		return r, stop
	}
	holds := func(r *relay.Relay, n int) func() bool { return func() bool { return len(r.Shards()) == n } }
	const soon = ttl / 12 // well before a renewal round, which comes every ttl/3

	first, _ := start("first")
	require.Eventually(t, holds(first, 4), 30*time.Second, 10*time.Millisecond)

	second, stopSecond := start("second")
	require.Eventually(t, func() bool { return holds(first, 2)() && holds(second, 2)() }, soon, 10*time.Millisecond,
		"shards after a relay joined: first %v, second %v", first.Shards(), second.Shards())

	stopSecond()
	require.Eventually(t, holds(first, 4), soon, 10*time.Millisecond, "shards after a relay stopped: %v", first.Shards())
	b.write(t, true, "k", 10)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)
}
