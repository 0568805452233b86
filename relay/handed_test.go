package relay

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

// A look hands the first due message of a parked shard's one due slot to its worker, which
// publishes it without reading it again; but only a message found while the worker sat in the
// park it was woken from. A look that saw the worker parked just as it woke finds the message the
// worker is about to publish, and hands it over after the worker took the first copy: taken again
// by the next cycle, it would be published twice.
func TestAHandedMessageIsPublishedOnlyFromTheParkItWasFoundIn(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	ctx := context.Background()
	schema, err := sqlname.Schema(env.Schema)
	require.NoError(t, err)
	const shards = 16
	r := &Relay{
		cfg: Config{DB: env.Pool, Shards: shards, LeaseTTL: 10 * time.Second, BatchSize: DefaultBatchSize, BatchBytes: DefaultBatchBytes},
		sql: renderQueries(schema, outbox.Slots/shards), log: slog.New(slog.DiscardHandler), held: map[int]*lease{},
	}
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	msg := message.NewMessage("m-1", []byte("p"))
	outbox.SetPartitionKey(msg, "k")
	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, w.Publish(ctx, tx, "orders", msg))
	require.NoError(t, tx.Commit(ctx))

	shard := ShardOf("k", "m-1", shards)
	l := &lease{relay: r, shard: shard, slots: slotsOf(shard, shards), window: DefaultBatchSize,
		wake: make(chan struct{}, 1), stop: make(chan struct{}), ctx: ctx}
	l.dueSlot.Store(noSlot)
	r.held[shard] = l
	parkAndLook := func() {
		parked := make(chan struct{})
		go func() { defer close(parked); l.park(false) }()
		require.Eventually(t, func() bool { return l.parkedIn.Load() != 0 }, 10*time.Second, time.Millisecond)
		require.True(t, r.look(ctx), "the look finds the message")
		<-parked
	}

	parkAndLook()
	batch, handed, err := l.next()
	require.NoError(t, err)
	require.True(t, handed, "the look handed the message over")
	require.Len(t, batch, 1)
	require.Equal(t, "m-1", batch[0].uuid)
	require.Equal(t, []byte("p"), batch[0].payload)

	// A look that took the worker for parked still, in the park it has just left, hands the same
	// message over again. The worker publishes and completes its copy meanwhile.
	first, slot := batch[0], outbox.SlotOf("k", "m-1")
	l.handed.Store(&handover{park: l.parks, slot: slot, row: first})
	_, err = env.Pool.Exec(ctx, "DELETE FROM "+env.Q("txbox_outbox"))
	require.NoError(t, err)
	batch, handed, err = l.next()
	require.NoError(t, err)
	require.False(t, handed, "a message handed over for a park the worker has left is not taken")
	require.Empty(t, batch, "the message was published once")

	// Nor by the worker woken from its next park by the late look's wake-up.
	l.handed.Store(&handover{park: l.parks, slot: slot, row: first})
	l.wakeUp()
	l.park(false)
	batch, handed, err = l.next()
	require.NoError(t, err)
	require.False(t, handed)
	require.Empty(t, batch)
}
