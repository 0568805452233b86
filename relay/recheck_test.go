package relay_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/relay"
)

// flakyDB is the test database, through which one transaction can be made to fail to start, as
// it does when a connection breaks or the pool times out, or every statement, as while the
// database cannot be reached.
type flakyDB struct {
	*pgxpool.Pool
	failNext atomic.Bool
	failed   atomic.Int64
	down     atomic.Bool
	downWith atomic.Value // the error of every batch while down, when set; errUnreachable otherwise
}

var errUnreachable = errors.New("injected fault: dial tcp: connection refused")

// SendBatch fails the next batch that begins a transaction (pgx's Batch.BeginTx queues its BEGIN
// first), the way the relay starts every transaction.
func (d *flakyDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if d.down.Load() {
		err, ok := d.downWith.Load().(error)
		if !ok {
			err = errUnreachable
		}
		return pgx.FailedBatchResults(b, err)
	}
	if beginsTransaction(b) && d.failNext.CompareAndSwap(true, false) {
		d.failed.Add(1)
		return pgx.FailedBatchResults(b, errors.New("injected fault: connection reset by peer"))
	}
	return d.Pool.SendBatch(ctx, b)
}

// failNextAfter returns a context for the relay's Run in which, once arm is called, the next
// transaction the relay begins after reaching failpoint point fails.
func (d *flakyDB) failNextAfter(point string) (ctx context.Context, arm func()) {
	var armed atomic.Bool
	ctx = failpoint.WithHook(context.Background(), point, func() {
		if armed.CompareAndSwap(true, false) {
			d.failNext.Store(true)
		}
	})
	return ctx, func() { armed.Store(true) }
}

// beginsTransaction says whether b begins one of the relay's transactions (which may change rows),
// rather than one of its reads, which begin a read-only transaction of their own.
func beginsTransaction(b *pgx.Batch) bool {
	if len(b.QueuedQueries) == 0 {
		return false
	}
	first := strings.ToLower(b.QueuedQueries[0].SQL)
	return strings.HasPrefix(first, "begin") && !strings.HasSuffix(first, "read only")
}

// When Kafka says the shard's producer was fenced, the relay asks the database whether its lease
// is still its own. A lease taken over means drop the shard; a database that cannot answer right
// now (the check's transaction fails to start) says nothing about the lease, and the relay must
// keep the shard, open a new producer and go on publishing under the same token.
func TestLeaseRecheckThatFailsKeepsTheShard(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	db := &flakyDB{Pool: b.env.Pool}
	// After a batch is read and before it is published (and found fenced), the next transaction the
	// relay starts is the lease check: make it fail.
	ctx, arm := db.failNextAfter("relay.after-read")
	var logs proctest.Buffer
	r, err := relay.New(relay.Config{
		DB: db, Sink: b.kafkaSink(t, kafkatest.Brokers(t), true), Schema: b.env.Schema, Owner: "A",
		Shards: 1, LeaseTTL: 30 * time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("relay log:\n%s", logs.String())
		}
	})
	runUntilCleanup(t, ctx, r)

	first := b.write(t, true, "k", 1)
	require.Eventually(t, func() bool { return c.has(first...) && b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)
	token := r.Shards()[0]

	// Another producer opens the shard's transactional.id, as a relay whose lease had ended would:
	// the broker fences the relay's producer while the database lease is still the relay's.
	late, err := sarama.NewSyncProducer(kafkatest.Brokers(t), kafkatest.TransactionalProducer(b.env.Schema+"-shard-0"))
	require.NoError(t, err)
	require.NoError(t, late.Close())

	arm()
	second := b.write(t, true, "k", 1)
	require.Eventually(t, func() bool { return c.has(second...) && b.pending(t) == 0 }, 20*time.Second, 10*time.Millisecond,
		"the relay published the next row with a new producer")
	require.EqualValues(t, 1, db.failed.Load(), "the lease check failed once")
	require.Equal(t, map[int]int64{0: token}, r.Shards(), "the relay kept the shard under its token")
	require.NotContains(t, logs.String(), "lease lost")
	require.True(t, strings.Contains(logs.String(), "could not check the lease"), logs.String())
}

// The broker committed a batch, and the completion that deletes its rows fails to start (a lost
// connection): the relay completes those rows before it reads again, rather than publish them a
// second time.
func TestAFailedCompletionDoesNotPublishTheBatchAgain(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	db := &flakyDB{Pool: b.env.Pool}
	ctx, arm := db.failNextAfter("relay.after-publish")
	r, err := relay.New(relay.Config{
		DB: db, Sink: b.kafkaSink(t, kafkatest.Brokers(t), true), Schema: b.env.Schema,
		Shards: 1, LeaseTTL: 30 * time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelError + 1})),
	})
	require.NoError(t, err)
	runUntilCleanup(t, ctx, r)
	require.Eventually(t, func() bool { return len(r.Shards()) == 1 }, 30*time.Second, 10*time.Millisecond)

	arm()
	batch := b.write(t, true, "k", 20)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)
	require.EqualValues(t, 1, db.failed.Load(), "the completion failed once")
	// A later message of the same key arrives after any second copy of the batch would.
	last := b.write(t, true, "k", 1)
	require.Eventually(t, func() bool { return c.has(last...) }, 30*time.Second, 10*time.Millisecond)
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, u := range batch {
		require.Equal(t, 1, c.seen[u], "message %s published %d times", u, c.seen[u])
	}
}
