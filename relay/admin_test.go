package relay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// downSink is a broker that is down: every publish fails, so rows stay pending while a relay holds
// the leases.
type downSink struct{}

func (downSink) Open(context.Context, int, int64) (relay.ShardPublisher, error) {
	return downSink{}, nil
}
func (downSink) Publish(context.Context, []relay.Message) error {
	return errors.New("broker down for the test")
}
func (downSink) Close() error { return nil }

func newAdmin(t *testing.T, b *bundle, shards int) *relay.Admin {
	t.Helper()
	a, err := relay.NewAdmin(relay.AdminConfig{Schema: b.env.Schema, Shards: shards})
	require.NoError(t, err)
	return a
}

// The admin reports the backlog of every shard (pending rows per kind, failing rows, the oldest
// row's age, the relay holding it) in the running relays' layout, lists rows with filters and
// pages, and shows one row with its payload.
func TestAdminBacklogListAndGet(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	keys := []string{"order-1", "order-2", "order-3", "order-4", "order-5"}
	ids := map[string][]int64{}
	for i := range 15 {
		k := keys[i%len(keys)]
		u := b.writeTo(t, b.topic, k, []byte(fmt.Sprintf(`{"n":%d}`, i)), "note", k)
		var id int64
		require.NoError(t, b.env.Pool.QueryRow(ctx, "SELECT id FROM "+b.env.Q("txbox_outbox")+" WHERE uuid = $1", u).Scan(&id))
		ids[k] = append(ids[k], id)
	}
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = b.writer.Call(ctx, tx, chargeCall("pay-admin", 100))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	// One message failed once and waits for its next attempt.
	failing := ids["order-2"][0]
	_, err = b.env.Pool.Exec(ctx, "UPDATE "+b.env.Q("txbox_outbox")+` SET attempts = 1, first_attempt_at = now(),
		last_error = 'topic does not exist', next_attempt_at = now() + interval '1 hour' WHERE id = $1`, failing)
	require.NoError(t, err)

	// Before any relay ran, the layout is the default one and nobody holds a shard.
	backlog, err := newAdmin(t, b, 0).Backlog(ctx, b.env.Pool)
	require.NoError(t, err)
	require.Len(t, backlog, relay.DefaultShards)

	// A relay of 4 shards holds every lease; its broker is down, so everything stays pending.
	r, err := relay.New(relay.Config{DB: b.env.Pool, Sink: downSink{}, Schema: b.env.Schema, Owner: "A", Shards: 4,
		LeaseTTL: 30 * time.Second, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
	require.Eventually(t, func() bool { return len(r.Shards()) == 4 }, 10*time.Second, 5*time.Millisecond)

	admin := newAdmin(t, b, 0)
	backlog, err = admin.Backlog(ctx, b.env.Pool)
	require.NoError(t, err)
	require.Len(t, backlog, 4, "the running relays' layout")
	want := make([]relay.ShardBacklog, 4)
	for i := range want {
		want[i].Shard, want[i].Owner = i, "A"
	}
	for i := range 15 {
		want[relay.ShardOf(keys[i%len(keys)], "", 4)].Messages++
	}
	want[relay.ShardOf("pay-admin", "", 4)].Calls++
	want[relay.ShardOf("order-2", "", 4)].Failing++
	for i, s := range backlog {
		if s.Messages+s.Calls == 0 {
			require.Zero(t, s.OldestAge, "shard %d", i)
		}
		require.GreaterOrEqual(t, s.OldestAge, time.Duration(0))
		s.OldestAge = 0
		require.Equal(t, want[i], s, "shard %d", i)
	}

	all, err := admin.List(ctx, b.env.Pool, relay.Filter{})
	require.NoError(t, err)
	require.Len(t, all, 16)
	for i := 1; i < len(all); i++ {
		require.Less(t, all[i-1].ID, all[i].ID, "lowest ids first")
	}
	for _, row := range all {
		require.Nil(t, row.Payload, "List leaves payloads out")
		require.Positive(t, row.PayloadBytes)
		require.Equal(t, relay.ShardOf(row.PartitionKey, row.UUID, 4), row.Shard)
	}

	shard := relay.ShardOf("order-3", "", 4)
	inShard, err := admin.List(ctx, b.env.Pool, relay.Filter{Shards: []int{shard}, Kind: "message"})
	require.NoError(t, err)
	require.Equal(t, int(want[shard].Messages), len(inShard))

	fails, err := admin.List(ctx, b.env.Pool, relay.Filter{Failing: true})
	require.NoError(t, err)
	require.Len(t, fails, 1)
	require.Equal(t, failing, fails[0].ID)
	require.Equal(t, "topic does not exist", fails[0].LastError)
	require.Equal(t, 1, fails[0].Attempts)
	require.False(t, fails[0].NextAttemptAt.IsZero())
	require.False(t, fails[0].FirstAttemptAt.IsZero())

	calls, err := admin.List(ctx, b.env.Pool, relay.Filter{Kind: "call"})
	require.NoError(t, err)
	require.Len(t, calls, 1)
	require.Equal(t, "pay-admin", calls[0].IdempotencyKey)

	var paged []int64
	for after := int64(0); ; {
		page, err := admin.List(ctx, b.env.Pool, relay.Filter{PartitionKey: "order-1", AfterID: after, Limit: 2})
		require.NoError(t, err)
		if len(page) == 0 {
			break
		}
		for _, row := range page {
			paged = append(paged, row.ID)
		}
		after = page[len(page)-1].ID
	}
	require.Equal(t, ids["order-1"], paged)

	old, err := admin.List(ctx, b.env.Pool, relay.Filter{OlderThan: time.Hour})
	require.NoError(t, err)
	require.Empty(t, old)

	got, err := admin.Get(ctx, b.env.Pool, ids["order-4"][1])
	require.NoError(t, err)
	require.Equal(t, []byte(`{"n":8}`), got.Payload)
	require.Equal(t, "order-4", got.Metadata["note"])
	require.Equal(t, b.topic, got.Topic)
	require.Equal(t, "message", got.Kind)

	_, err = admin.Get(ctx, b.env.Pool, 1<<40)
	require.ErrorIs(t, err, relay.ErrRowNotFound)
	for _, f := range []relay.Filter{{Kind: "both"}, {Limit: -1}, {Limit: 10001}, {OlderThan: -time.Second}, {Shards: []int{-1}}} {
		_, err := admin.List(ctx, b.env.Pool, f)
		require.ErrorContains(t, err, "relay: Filter.", "%+v", f)
	}
	_, err = relay.NewAdmin(relay.AdminConfig{Schema: b.env.Schema, Shards: 3})
	require.ErrorContains(t, err, "AdminConfig.Shards")
}

// Burying a message the broker keeps refusing moves it to the DLQ with the operator's reason and its
// last error, and lets the later messages of its key, which waited behind it, go out at once. A
// call can be buried too; its letter keeps its idempotency key. Burying needs a reason, and a row
// that is not pending is not found.
func TestAdminBury(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.collect(t)
	refused := b.writeTo(t, b.topic, "k", []byte(`{"n":1}`), "", "")
	var id int64
	require.NoError(t, b.env.Pool.QueryRow(ctx, "SELECT id FROM "+b.env.Q("txbox_outbox")+" WHERE uuid = $1", refused).Scan(&id))
	// As if the broker had refused it three times: it holds back its key for an hour.
	_, err := b.env.Pool.Exec(ctx, "UPDATE "+b.env.Q("txbox_outbox")+` SET attempts = 3, first_attempt_at = now() - interval '2 hours',
		last_error = 'topic does not exist', next_attempt_at = now() + interval '1 hour' WHERE id = $1`, id)
	require.NoError(t, err)
	behind := b.write(t, true, "k", 3)
	other := b.write(t, true, "other", 2)
	b.startRelay(t, nil)
	require.Eventually(t, func() bool { return c.has(other...) }, 30*time.Second, 10*time.Millisecond)
	// The relay deletes a batch after Kafka made it visible, so the consumer can be first.
	require.Eventually(t, func() bool { return b.pending(t) == 4 }, 10*time.Second, 5*time.Millisecond,
		"the refused message holds back its key only")
	require.ElementsMatch(t, behind, b.pendingAmong(t, behind), "its key's later messages wait")

	admin := newAdmin(t, b, 0)
	_, err = admin.Bury(ctx, b.env.Pool, id, "  ")
	require.ErrorContains(t, err, "reason")
	row, err := admin.Bury(ctx, b.env.Pool, id, "the topic was retired; ticket OPS-12")
	require.NoError(t, err)
	require.Equal(t, refused, row.UUID)
	require.Eventually(t, func() bool { return c.has(behind...) && b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond,
		"the later messages of its key went out")
	require.Zero(t, c.count(refused))

	letters := b.relayLetters(t)
	require.Len(t, letters, 1)
	require.Equal(t, refused, letters[0].uuid)
	require.Equal(t, relay.ReasonBuried, letters[0].reason)
	require.Contains(t, letters[0].errText, "OPS-12")
	require.Contains(t, letters[0].errText, "topic does not exist")
	require.Equal(t, 3, letters[0].attempts)
	var failingFor time.Duration
	require.NoError(t, b.env.Pool.QueryRow(ctx, "SELECT extract(epoch FROM now() - first_failed_at)::bigint * 1000000000 FROM "+
		b.env.Q("txbox_dlq")+" WHERE uuid = $1", refused).Scan(&failingFor))
	require.InDelta(t, 2*time.Hour, failingFor, float64(10*time.Minute), "the letter first failed when the row's first attempt did, not when it was buried")

	_, err = admin.Bury(ctx, b.env.Pool, id, "again")
	require.ErrorIs(t, err, relay.ErrRowNotFound)

	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = b.writer.Call(ctx, tx, chargeCall("pay-bury", 100))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	calls, err := admin.List(ctx, b.env.Pool, relay.Filter{Kind: "call"})
	require.NoError(t, err)
	require.Len(t, calls, 1)
	_, err = admin.Bury(ctx, b.env.Pool, calls[0].ID, "charged by hand")
	require.NoError(t, err)
	var kind, key string
	require.NoError(t, b.env.Pool.QueryRow(ctx, "SELECT kind, idempotency_key FROM "+b.env.Q("txbox_dlq")+" WHERE uuid = $1",
		calls[0].UUID).Scan(&kind, &key))
	require.Equal(t, "call", kind)
	require.Equal(t, "pay-bury", key)
}

// Bury takes the shard's lease row lock like the relay's fenced transactions. A relay holding it
// to complete a batch makes Bury wait; once the relay committed, the row is gone and Bury finds
// nothing to bury: never both completed and dead.
func TestAdminBuryWaitsForARelayCompletingTheRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	sink := &memSink{}
	// Hold the relay inside the completion transaction of its first batch, holding the lease lock.
	var published bool
	g := newGate()
	hooked := failpoint.WithHook(ctx, "relay.after-publish", func() { published = true })
	hooked = failpoint.WithHook(hooked, "relay.lease-locked", func() {
		if published {
			g.hold()
		}
	})
	var logs proctest.Buffer
	r, err := relay.New(relay.Config{DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Owner: "A", Shards: 1,
		LeaseTTL: 30 * time.Second, PollInterval: 10 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(hooked)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	t.Cleanup(func() { g.open(); cancel(); require.NoError(t, <-done) })

	m := outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), []byte("x")), "k")
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, b.writer.Publish(ctx, tx, b.topic, m))
	require.NoError(t, tx.Commit(ctx))
	var id int64
	require.NoError(t, b.env.Pool.QueryRow(ctx, "SELECT id FROM "+b.env.Q("txbox_outbox")+" WHERE uuid = $1", m.UUID).Scan(&id))
	g.wait(t, "the relay locked its lease to complete the batch")

	conn, err := b.env.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	var pid int
	require.NoError(t, conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	var wg sync.WaitGroup
	var buryErr error
	wg.Go(func() { _, buryErr = newAdmin(t, b, 0).Bury(ctx, conn.Conn(), id, "stuck") })
	require.Eventually(t, func() bool {
		var blocked bool
		require.NoError(t, b.env.Pool.QueryRow(ctx, "SELECT cardinality(pg_blocking_pids($1)) > 0", pid).Scan(&blocked))
		return blocked
	}, 10*time.Second, 5*time.Millisecond, "Bury waits for the relay's lease lock")

	g.open()
	wg.Wait()
	require.ErrorIs(t, buryErr, relay.ErrRowNotFound, "the relay completed the row first")
	require.Zero(t, b.pending(t))
	require.Empty(t, b.relayLetters(t), "nothing dead")
	sink.mu.Lock()
	defer sink.mu.Unlock()
	require.Len(t, sink.msgs, 1)
}
