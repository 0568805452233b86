package relay_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/puddle/v2"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/relay"
)

// Ready is nil only while the relay runs with its database and its broker answering; otherwise it
// says which of them keeps the relay from working: a broker that refuses connections, one that
// takes them and answers nothing, a database that cannot be reached. The Kafka outage needs a broker of the test's
// own that it can break, so this test always uses an in-process cluster.
func TestReadyNamesWhatKeepsTheRelayFromWorking(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cluster, err := kafkatest.Start()
	require.NoError(t, err)
	t.Cleanup(cluster.Close)
	var kafkaDown, kafkaFrozen atomic.Bool
	thaw, thawOnce := make(chan struct{}), sync.Once{}
	t.Cleanup(func() { thawOnce.Do(func() { close(thaw) }) }) // a failed test must not leave the cluster frozen
	cluster.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if kafkaFrozen.Load() {
			<-thaw // takes connections, answers nothing
		}
		if kafkaDown.Load() {
			return nil, errors.New("broker down for the test"), true // closes the connection
		}
		return nil, nil, false
	})
	db := &flakyDB{Pool: b.env.Pool}
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: cluster.ListenAddrs(), TransactionalIDPrefix: b.env.Schema})
	require.NoError(t, err)
	r, err := relay.New(relay.Config{
		DB: db, Sink: sink, Schema: b.env.Schema, Shards: 4,
		LeaseTTL: time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	require.NoError(t, err)
	notReadyFor := func(reason string) func() bool {
		return func() bool {
			err := r.Ready()
			return errors.Is(err, relay.ErrNotReady) && strings.Contains(err.Error(), reason)
		}
	}
	require.True(t, notReadyFor("not running")(), "before Run: %v", r.Ready())

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	ready := func() bool { return r.Ready() == nil }
	require.Eventually(t, ready, 30*time.Second, 10*time.Millisecond, "running: %v", r.Ready())
	b.write(t, true, "before", 5)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)

	kafkaDown.Store(true)
	b.write(t, true, "during-kafka-outage", 5)
	require.Eventually(t, notReadyFor("publishing fails on"), 60*time.Second, 10*time.Millisecond, "Kafka down: %v", r.Ready())
	kafkaDown.Store(false)
	require.Eventually(t, ready, 60*time.Second, 10*time.Millisecond, "Kafka back: %v", r.Ready())
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)

	// A broker that takes connections and answers nothing gives sarama no error for minutes.
	kafkaFrozen.Store(true)
	b.write(t, true, "during-kafka-freeze", 5)
	require.Eventually(t, notReadyFor("the broker has not answered for 1s"), 60*time.Second, 10*time.Millisecond, "Kafka frozen: %v", r.Ready())
	kafkaFrozen.Store(false)
	thawOnce.Do(func() { close(thaw) })
	require.Eventually(t, ready, 60*time.Second, 10*time.Millisecond, "Kafka thawed: %v", r.Ready())
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)

	// The database shuts down, then refuses connections: Ready says what is wrong now.
	db.downWith.Store(errors.New("injected fault: the database system is shutting down"))
	db.down.Store(true)
	require.Eventually(t, notReadyFor("publishing fails on"), 30*time.Second, 10*time.Millisecond, "database down: %v", r.Ready())
	db.downWith.Store(errUnreachable)
	require.Eventually(t, func() bool {
		err := r.Ready()
		return notReadyFor("database: ")() && notReadyFor("publishing fails on")() && !strings.Contains(err.Error(), "shutting down")
	}, 30*time.Second, 10*time.Millisecond, "the latest failure, not the outage's first: %v", r.Ready())
	require.ErrorIs(t, r.Ready(), errUnreachable, "the cause is kept")
	db.down.Store(false)
	require.Eventually(t, ready, 30*time.Second, 10*time.Millisecond, "database back: %v", r.Ready())

	// The lease table lost its leases (its rows were deleted), and a live relay of another layout
	// keeps this one from making them again.
	_, err = b.env.Pool.Exec(ctx, "INSERT INTO "+b.env.Q("txbox_relay_node")+
		" (owner, expires_at, shards) VALUES ('other-layout', now() + interval '1 hour', 8)")
	require.NoError(t, err)
	_, err = b.env.Pool.Exec(ctx, "DELETE FROM "+b.env.Q("txbox_lease"))
	require.NoError(t, err)
	require.Eventually(t, notReadyFor("leases: relay: Config.Shards is 4 but running relays"), 30*time.Second, 10*time.Millisecond,
		"leases cannot be made: %v", r.Ready())
	_, err = b.env.Pool.Exec(ctx, "DELETE FROM "+b.env.Q("txbox_relay_node")+" WHERE owner = 'other-layout'")
	require.NoError(t, err)
	require.Eventually(t, ready, 30*time.Second, 10*time.Millisecond, "leases made again: %v", r.Ready())

	cancel()
	require.NoError(t, <-done)
	done <- nil // for the cleanup
	require.True(t, notReadyFor("not running")(), "after Run: %v", r.Ready())
}

// A pool closed under a running relay never comes back: Run returns an error that says so instead
// of retrying for ever as for an outage, so a process whose pool was closed first (a wrong order
// of deferred calls) exits rather than hang with its leases expiring.
func TestRunReturnsWhenItsPoolIsClosed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, err := pgxpool.NewWithConfig(context.Background(), b.env.Pool.Config().Copy())
	require.NoError(t, err)
	r := b.newRelay(t, func(c *relay.Config) { c.DB = pool })

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	require.Eventually(t, func() bool { return r.Ready() == nil }, 30*time.Second, 10*time.Millisecond, "running: %v", r.Ready())
	b.write(t, true, "before", 5)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)

	pool.Close()
	select {
	case err := <-done:
		require.ErrorIs(t, err, puddle.ErrClosedPool)
	case <-time.After(time.Minute): // a hang guard, far above the lease tick of LeaseTTL/3
		t.Fatal("Run still runs a minute after its pool was closed")
	}
	require.ErrorIs(t, r.Ready(), relay.ErrNotReady)
}

// A relay that executes no calls (no Config.Calls: txbox relay without STRIPE_API_KEY) and holds a
// shard in which a call waits is not ready, and says why, once in its log too: in a fleet where
// some relays lacked the key, the calls of the shards they held waited for ever, every relay ready
// and nothing in the log. Once no call waits there, it is ready again.
func TestARelayThatExecutesNoCallsIsNotReadyWhileACallWaitsInItsShards(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var logs proctest.Buffer
	r := b.startRelay(t, func(c *relay.Config) {
		c.StatsInterval = 20 * time.Millisecond
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	})
	require.Eventually(t, func() bool { return r.Ready() == nil && len(r.Shards()) == 4 }, 30*time.Second, 10*time.Millisecond, "%v", r.Ready())
	ctx := context.Background()
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = b.writer.Call(ctx, tx, chargeCall("pay-stranded", 100))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Eventually(t, func() bool {
		err := r.Ready()
		return errors.Is(err, relay.ErrNotReady) && strings.Contains(err.Error(), "calls: side-effect calls wait in shards this relay holds")
	}, 30*time.Second, 10*time.Millisecond, "%v", r.Ready())
	require.Equal(t, 1, strings.Count(logs.String(), "it executes none"), "logged once\n%s", logs.String())

	admin := newAdmin(t, b, 0)
	calls, err := admin.List(ctx, b.env.Pool, relay.Filter{Kind: "call"})
	require.NoError(t, err)
	require.Len(t, calls, 1)
	_, err = admin.Bury(ctx, b.env.Pool, calls[0].ID, "charged by hand")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return r.Ready() == nil }, 30*time.Second, 10*time.Millisecond, "%v", r.Ready())
	require.Contains(t, logs.String(), "no call waits in the shards this relay holds any more")
}
