package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

type bundle struct {
	env    *txtest.Env
	writer *outbox.Writer
	topic  string
}

func setup(t *testing.T) *bundle {
	t.Helper()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	return &bundle{env: env, writer: w, topic: kafkatest.Topic(t)}
}

// runUntilCleanup runs r in ctx until the test ends, and requires that it then stops cleanly.
func runUntilCleanup(t *testing.T, ctx context.Context, r *relay.Relay) {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

// startRelay runs an in-process relay until the test ends.
func (b *bundle) startRelay(t *testing.T, mutate func(*relay.Config)) *relay.Relay {
	t.Helper()
	r := b.newRelay(t, mutate)
	runUntilCleanup(t, context.Background(), r)
	return r
}

// newRelay makes the relay startRelay runs, without running it.
func (b *bundle) newRelay(t *testing.T, mutate func(*relay.Config)) *relay.Relay {
	t.Helper()
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t), TransactionalIDPrefix: b.env.Schema})
	require.NoError(t, err)
	cfg := relay.Config{
		DB: b.env.Pool, Sink: sink, Schema: b.env.Schema,
		Shards: 4, LeaseTTL: 2 * time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	r, err := relay.New(cfg)
	require.NoError(t, err)
	return r
}

// collect subscribes to topic and records every message UUID it sees, in arrival order per key.
type collector struct {
	mu    sync.Mutex
	seen  map[string]int
	order map[string][]string // partition key → UUIDs in arrival order
}

func (b *bundle) collect(t *testing.T) *collector {
	t.Helper()
	sub := kafkatest.NewSubscriber(t, "g-"+watermill.NewShortUUID())
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := sub.Subscribe(ctx, b.topic)
	require.NoError(t, err)
	c := &collector{seen: map[string]int{}, order: map[string][]string{}}
	go func() {
		for m := range ch {
			c.mu.Lock()
			c.seen[m.UUID]++
			k := m.Metadata.Get(outbox.PartitionKeyMetadata)
			c.order[k] = append(c.order[k], m.UUID)
			c.mu.Unlock()
			m.Ack()
		}
	}()
	return c
}

func (c *collector) has(uuids ...string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, u := range uuids {
		if c.seen[u] == 0 {
			return false
		}
	}
	return true
}

func (c *collector) count(uuid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.seen[uuid]
}

func (b *bundle) write(t *testing.T, commit bool, key string, n int) []string {
	t.Helper()
	ctx := context.Background()
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	var uuids []string
	for range n {
		m := message.NewMessage(watermill.NewUUID(), []byte(`{"hello":"world"}`))
		outbox.SetPartitionKey(m, key)
		require.NoError(t, b.writer.Publish(ctx, tx, b.topic, m))
		uuids = append(uuids, m.UUID)
	}
	if commit {
		require.NoError(t, tx.Commit(ctx))
	} else {
		require.NoError(t, tx.Rollback(ctx))
	}
	return uuids
}

func (b *bundle) pending(t *testing.T) int {
	var n int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.env.Q("txbox_outbox")).Scan(&n))
	return n
}

func TestCommittedRowsArePublishedRolledBackNever(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	rolledBack := b.write(t, false, "k1", 5)
	committed := b.write(t, true, "k1", 20)
	committed = append(committed, b.write(t, true, "", 20)...)
	b.startRelay(t, nil)

	require.Eventually(t, func() bool { return c.has(committed...) }, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 10*time.Second, 20*time.Millisecond)
	// A message written after the committed ones is a marker: once it arrives, anything the
	// rolled-back transaction could have produced would have arrived before it on the same key.
	marker := b.write(t, true, "k1", 1)
	require.Eventually(t, func() bool { return c.has(marker...) }, 30*time.Second, 20*time.Millisecond)
	for _, u := range rolledBack {
		require.Zero(t, c.count(u), "a message from a rolled-back transaction reached Kafka")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	require.Equal(t, append(committed[:20:20], marker...), c.order["k1"], "per-key order")
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(p))
	return len(p), nil
}

var _ = fmt.Sprintf

// A running relay whose lease table was made again (txbox migrate down, then up, beside it: the
// table dropped with its rows, then created empty) makes its layout's leases again and publishes.
// Before, it made them only when it started: it stayed live and healthy holding no shard, and an
// audit saw 14,243 rows wait until it was restarted.
func TestARelayMakesItsLeasesAgainWhenTheTableLostThem(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	r := b.startRelay(t, nil)
	first := b.write(t, true, "k", 1)
	require.Eventually(t, func() bool { return c.has(first...) }, 30*time.Second, 20*time.Millisecond)

	before := r.Shards()
	_, err := b.env.Pool.Exec(context.Background(), "DELETE FROM "+b.env.Q("txbox_lease"))
	require.NoError(t, err)
	// Written once the relay holds none of the leases it held: a relay that still believed it held
	// one would publish the message (and fail to complete it) with or without the leases made again.
	require.Eventually(t, func() bool {
		for shard, token := range r.Shards() {
			if before[shard] == token {
				return false
			}
		}
		return true
	}, 30*time.Second, 10*time.Millisecond, "the leases are lost")
	later := b.write(t, true, "k", 1)
	require.Eventually(t, func() bool { return c.has(later...) }, 30*time.Second, 20*time.Millisecond,
		"the relay made its leases again and published")
}
