package retention_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/inboxgen"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/retention"
)

// rotating makes every pass start a new generation.
var rotating = retention.Config{InboxGeneration: time.Microsecond}

func (tb *testBundle) partitions(t *testing.T) []string {
	t.Helper()
	rows, err := tb.env.Pool.Query(context.Background(), `SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
		WHERE i.inhparent = $1::regclass ORDER BY c.relname`, tb.env.Q("txbox_inbox"))
	require.NoError(t, err)
	defer rows.Close()
	var out []string
	for rows.Next() {
		var name string
		require.NoError(t, rows.Scan(&name))
		out = append(out, name)
	}
	require.NoError(t, rows.Err())
	return out
}

// consumer is an inbox whose handler counts its runs per message UUID.
type consumer struct {
	ib  *inbox.Inbox
	mu  sync.Mutex
	ran map[string]int
	// hold, when set, is called in the handler's transaction before it returns.
	hold func(uuid string)
}

func (tb *testBundle) consumer(t *testing.T, cfg inbox.Config) *consumer {
	t.Helper()
	cfg.Schema = tb.env.Schema
	if cfg.DB == nil {
		cfg.DB = tb.env.Pool
	}
	if cfg.Consumer == "" {
		cfg.Consumer = "billing"
	}
	ib, err := inbox.New(cfg, nil)
	require.NoError(t, err)
	return &consumer{ib: ib, ran: map[string]int{}}
}

func (c *consumer) deliver(uuid string) error {
	_, err := c.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if c.hold != nil {
			c.hold(msg.UUID)
		}
		c.mu.Lock()
		c.ran[msg.UUID]++
		c.mu.Unlock()
		return nil, nil
	})(message.NewMessage(uuid, nil))
	return err
}

// freeze delivers uuid in the background and returns once its handler runs, with its transaction
// open; the delivery ends, on done, after thaw.
func (c *consumer) freeze(uuid string) (done <-chan error, thaw func()) {
	frozen, thawed := make(chan struct{}), make(chan struct{})
	c.hold = func(u string) {
		if u == uuid {
			close(frozen)
			<-thawed
		}
	}
	result := make(chan error, 1)
	go func() { result <- c.deliver(uuid) }()
	<-frozen
	return result, func() { close(thawed) }
}

func (c *consumer) runs(uuid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ran[uuid]
}

// Old rows go with their generation, dropped whole: no row is deleted one by one.
func TestOldGenerationsAreDroppedWhole(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.inbox(t, "billing", "old", "done", 2500, 9*day)
	tb.inbox(t, "shipping", "old", "done", 3, 30*day)
	require.Equal(t, []string{"txbox_inbox_g0"}, tb.partitions(t))

	rep, err := tb.cleaner(t, rotating).RunOnce(ctx)
	require.NoError(t, err)
	require.True(t, rep.Rotated)
	require.Equal(t, int64(1), rep.Generation)
	require.Equal(t, []int64{0}, rep.GenerationsDropped)
	require.Zero(t, rep.DoneDeleted)
	for _, n := range tb.db.batches["txbox_inbox"] {
		require.Zero(t, n, "no inbox row is deleted one by one")
	}
	require.Equal(t, []string{"txbox_inbox_g1"}, tb.partitions(t))
	require.Zero(t, tb.count(t, "txbox_inbox", "true"))

	// Rows received in generation 1 keep it while its newest row is within InboxRetention, after
	// it stopped being current too. Its rows past the cutoff meanwhile are neither deleted nor
	// moved: it takes no insert any more, so that would only leave dead tuples before the drop.
	tb.inbox(t, "billing", "young", "done", 10, 7*day)
	tb.inbox(t, "billing", "older", "done", 10, 9*day)
	tb.inbox(t, "billing", "discarded", "dead", 1, 9*day)
	tb.inbox(t, "billing", "redriven", "done", 1, 9*day)
	tb.redriven(t, "redriven-1", day)
	rep, err = tb.cleaner(t, rotating).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2), rep.Generation)
	require.Empty(t, rep.GenerationsDropped)
	require.Equal(t, []string{"txbox_inbox_g1", "txbox_inbox_g2"}, tb.partitions(t))
	require.Equal(t, 22, tb.count(t, "txbox_inbox", "generation = 1"), "no row of a generation to be dropped goes before it")
	require.Zero(t, rep.DoneDeleted)
	require.Zero(t, rep.DeadDeleted)
	require.Zero(t, rep.RedrivenKept)

	// Once its newest row is past the cutoff, it goes whole; the row that must stay moves out
	// first. A generation is current for InboxGeneration.
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_inbox")+` SET received_at = now() - interval '9 days' WHERE dedup_key LIKE 'young-%'`)
	rep, err = tb.cleaner(t, retention.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.False(t, rep.Rotated)
	require.Equal(t, int64(2), rep.Generation)
	require.Equal(t, []int64{1}, rep.GenerationsDropped)
	require.Equal(t, int64(1), rep.GenerationRowsMoved)
	require.Zero(t, rep.DoneDeleted)
	require.Zero(t, rep.DeadDeleted)
	require.Equal(t, []string{"txbox_inbox_g2"}, tb.partitions(t))
	require.Equal(t, []string{"redriven-1"}, tb.keys(t, "txbox_inbox", "received_at > now() - interval '25 hours'"))
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "true"))
	for _, n := range tb.db.batches["txbox_inbox"] {
		require.Zero(t, n, "no inbox row is deleted one by one")
	}
}

// A dead row whose letter waits, and the rows of a message redriven since the cutoff, outlive
// their generation: they move to the current one, and still make deliveries duplicates.
func TestRowsThatMustStayMoveOutOfADroppedGeneration(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.inbox(t, "billing", "waiting", "dead", 1, 9*day)
	tb.letter(t, "inbox", "billing", "waiting-1", 0)
	tb.inbox(t, "billing", "discarded", "dead", 1, 9*day)
	tb.inbox(t, "billing", "redriven", "done", 1, 10*day)
	tb.redriven(t, "redriven-1", day)
	tb.inbox(t, "billing", "processed", "done", 1, 9*day)

	rep, err := tb.cleaner(t, rotating).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, []int64{0}, rep.GenerationsDropped)
	require.Equal(t, int64(2), rep.GenerationRowsMoved)
	require.Equal(t, []string{"redriven-1", "waiting-1"}, tb.keys(t, "txbox_inbox", "generation = 1"))
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "dedup_key = 'redriven-1' AND received_at > now() - interval '25 hours'"),
		"a redriven message is remembered for InboxRetention from its redrive")

	// Without attempt counting, the insert alone finds the rows.
	c := tb.consumer(t, inbox.Config{MaxAttempts: -1})
	for _, uuid := range []string{"waiting-1", "redriven-1", "processed-1"} {
		require.NoError(t, c.deliver(uuid))
	}
	require.Zero(t, c.runs("waiting-1"), "the dead row moved with its letter waiting")
	require.Zero(t, c.runs("redriven-1"), "the redriven message's row moved")
	require.Equal(t, 1, c.runs("processed-1"), "forgotten with its generation")

	// The current generation cannot be dropped: a row moved into it goes one by one once its reason
	// went, the letter discarded.
	tb.exec(t, `DELETE FROM `+tb.env.Q("txbox_dlq")+` WHERE dedup_key = 'waiting-1'`)
	rep, err = tb.cleaner(t, retention.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), rep.DeadDeleted)
	require.Zero(t, tb.count(t, "txbox_inbox", "dedup_key = 'waiting-1'"))
}

// A pass whose rotation gives up on the control row, held by another Cleaner's rotation, still
// knows the current generation: it deletes only there.
func TestAPassDeferredByAnotherRotationDeletesOnlyInTheCurrentGeneration(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.inbox(t, "billing", "old", "done", 5, 9*day)
	tb.inbox(t, "billing", "young", "done", 1, day)
	_, err := tb.cleaner(t, rotating).RunOnce(ctx)
	require.NoError(t, err)
	tb.inbox(t, "billing", "stale", "done", 1, 9*day)

	other, err := tb.env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx) //nolint:errcheck // The test ends it.
	_, err = other.Exec(ctx, `SELECT 1 FROM `+tb.env.Q("txbox_inbox_generation")+` FOR UPDATE`)
	require.NoError(t, err)
	rep, err := tb.cleaner(t, retention.Config{InboxGeneration: time.Microsecond, GenerationLockTimeout: 50 * time.Millisecond}).RunOnce(ctx)
	require.NoError(t, err)
	require.NoError(t, other.Rollback(ctx))
	require.True(t, rep.RotationDeferred)
	require.Equal(t, int64(1), rep.Generation)
	require.Equal(t, int64(1), rep.DoneDeleted)
	require.Zero(t, tb.count(t, "txbox_inbox", "generation = 1"))
	require.Equal(t, 6, tb.count(t, "txbox_inbox", "generation = 0"), "the old generation waits to be dropped whole")
}

// A delivery that starts in one generation and one of the same message in the next could not see
// each other: a rotation waits for the deliveries in flight. A frozen one (a consumer stopped in
// its handler) holds the rotation back, but only up to GenerationLockTimeout, so the deliveries
// queued behind the rotation go on; the next pass rotates.
func TestAFrozenDeliveryDefersTheRotationAndHoldsUpNoOther(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	c := tb.consumer(t, inbox.Config{LockTimeout: -1})
	frozenDone, thaw := c.freeze("frozen")

	waiting := func(mode string) bool {
		var n int
		require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks
			WHERE locktype = 'relation' AND relation = $1::regclass AND mode = $2 AND NOT granted`,
			tb.env.Q("txbox_inbox_generation"), mode).Scan(&n))
		return n > 0
	}
	type result struct {
		rep retention.Report
		err error
	}
	rotation := make(chan result, 1)
	go func() {
		rep, err := tb.cleaner(t, retention.Config{InboxGeneration: time.Microsecond, GenerationLockTimeout: 2 * time.Second}).RunOnce(ctx)
		rotation <- result{rep, err}
	}()
	require.Eventually(t, func() bool { return waiting("ExclusiveLock") }, 10*time.Second, time.Millisecond,
		"the rotation waits for the frozen delivery")

	otherDone := make(chan error, 1)
	go func() { otherDone <- c.deliver("other") }()
	var queued atomic.Bool
	var res result
	require.Eventually(t, func() bool {
		if waiting("RowShareLock") {
			queued.Store(true)
		}
		select {
		case res = <-rotation:
			return true
		default:
			return false
		}
	}, 30*time.Second, time.Millisecond)
	require.NoError(t, res.err)
	require.True(t, res.rep.RotationDeferred)
	require.False(t, res.rep.Rotated)
	require.Equal(t, int64(0), res.rep.Generation)
	require.Contains(t, tb.log.String(), "deliveries in flight held it back")
	t.Logf("the other delivery was seen queued behind the rotation: %v", queued.Load())

	select {
	case err := <-otherDone:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("a delivery is held up by a frozen one")
	}
	require.Equal(t, 1, c.runs("other"))
	select {
	case <-frozenDone:
		t.Fatal("the frozen delivery ended before it was thawed")
	default:
	}

	thaw()
	require.NoError(t, <-frozenDone)
	rep, err := tb.cleaner(t, rotating).RunOnce(ctx)
	require.NoError(t, err)
	require.True(t, rep.Rotated, "the next pass rotates")
	require.Equal(t, int64(1), rep.Generation)

	// Both messages are remembered across the rotation, by the attempt counter's check and, for a
	// consumer that counts no attempts, by the insert's; a new one goes into the new generation.
	uncounted := tb.consumer(t, inbox.Config{MaxAttempts: -1})
	for _, uuid := range []string{"frozen", "other", "new"} {
		require.NoError(t, c.deliver(uuid))
		require.Equal(t, 1, c.runs(uuid), uuid)
		require.NoError(t, uncounted.deliver(uuid))
		require.Zero(t, uncounted.runs(uuid), uuid)
	}
	require.Equal(t, []string{"new"}, tb.keys(t, "txbox_inbox", "generation = 1"))
}

// A delivery whose transaction is REPEATABLE READ (the database's or role's default) and that waits
// behind a rotation takes its snapshot only once the rotation committed: one taken before would
// still see the old generation current, and not see a delivery of the same message that inserted
// into the new one and committed, so both would process the message.
func TestARepeatableReadDeliveryBehindARotationSeesTheNewGeneration(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(tb.env.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	cfg.ConnConfig.RuntimeParams["application_name"] = "txbox-rr-" + tb.env.Schema
	rrPool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(rrPool.Close)
	waitingForLock := func(where string, args ...any) bool {
		var n int
		require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND `+where, args...).Scan(&n))
		return n > 0
	}

	plain := tb.consumer(t, inbox.Config{MaxAttempts: -1, LockTimeout: -1})
	frozenDone, thaw := plain.freeze("frozen")
	rotation := make(chan error, 1)
	go func() {
		rep, err := tb.cleaner(t, retention.Config{InboxGeneration: time.Microsecond, GenerationLockTimeout: time.Minute}).RunOnce(ctx)
		if err == nil && !rep.Rotated {
			err = fmt.Errorf("no rotation: %+v", rep)
		}
		rotation <- err
	}()
	require.Eventually(t, func() bool { return waitingForLock("strpos(query, $1) > 0", tb.env.Schema) }, 10*time.Second, time.Millisecond,
		"the rotation waits for the frozen delivery")

	// The repeatable-read delivery queues behind the rotation, and once in its handler waits
	// until the other delivery of its message waits for its row, or has processed the message.
	rr := tb.consumer(t, inbox.Config{DB: rrPool, MaxAttempts: -1, LockTimeout: -1})
	var otherDone atomic.Bool
	rr.hold = func(string) {
		for range 500 {
			if otherDone.Load() || waitingForLock("wait_event = 'transactionid' AND application_name <> $1 AND strpos(query, $2) > 0", cfg.ConnConfig.RuntimeParams["application_name"], tb.env.Schema) {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	rrDone := make(chan error, 1)
	go func() { rrDone <- rr.deliver("m") }()
	require.Eventually(t, func() bool {
		return waitingForLock("application_name = $1", cfg.ConnConfig.RuntimeParams["application_name"])
	}, 10*time.Second, time.Millisecond,
		"the repeatable-read delivery waits behind the rotation")

	thaw()
	require.NoError(t, <-frozenDone)
	require.NoError(t, <-rotation)
	require.NoError(t, plain.deliver("m"))
	otherDone.Store(true)
	require.NoError(t, <-rrDone)
	require.Equal(t, 1, plain.runs("m")+rr.runs("m"), "the message was processed by both deliveries")
}

// A delivery that waits for the generation lock gives up after its own LockTimeout, transiently,
// like any lock wait: the message is retried and not charged an attempt.
func TestGenerationLockWaitIsBoundedByTheInboxLockTimeout(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tx, err := tb.env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // The test ends it.
	quoted, err := sqlname.Schema(tb.env.Schema)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, sqlname.Render(inboxgen.RotationLock, quoted))
	require.NoError(t, err)

	c := tb.consumer(t, inbox.Config{LockTimeout: 50 * time.Millisecond})
	err = c.deliver("m")
	require.ErrorContains(t, err, "lock timeout")
	require.Zero(t, c.runs("m"))
	require.Zero(t, tb.count(t, "txbox_inbox_attempt", "attempts > 0"), "a lock timeout is not the message's failure")

	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, c.deliver("m"))
	require.Equal(t, 1, c.runs("m"))
}

// Consumers of the versions before the generation lock was a LOCK TABLE (3b1ae55) hold an advisory
// lock shared while they insert, which the rotation's EXCLUSIVE lock does not wait for. While they
// still run, as in a rolling upgrade, a rotation waits for them too: otherwise one of their
// deliveries inserting into the old generation and a delivery of the same message in the new one
// would both process it.
func TestARotationWaitsForADeliveryOfAnEarlierVersion(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	quoted, err := sqlname.Schema(tb.env.Schema)
	require.NoError(t, err)
	earlier, err := tb.env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer earlier.Rollback(ctx) //nolint:errcheck // The test ends it.
	// The lock as those versions took it, spelled out: they do not change with this one.
	_, err = earlier.Exec(ctx, sqlname.Render(`SELECT pg_advisory_xact_lock_shared(1953063522, '{schema}.txbox_inbox'::regclass::oid::int)`, quoted))
	require.NoError(t, err)

	rep, err := tb.cleaner(t, retention.Config{InboxGeneration: time.Microsecond, GenerationLockTimeout: 200 * time.Millisecond}).RunOnce(ctx)
	require.NoError(t, err)
	require.True(t, rep.RotationDeferred, "the rotation waits for the earlier version's delivery in flight")
	require.False(t, rep.Rotated)
	require.Equal(t, int64(0), rep.Generation)

	require.NoError(t, earlier.Commit(ctx))
	rep, err = tb.cleaner(t, rotating).RunOnce(ctx)
	require.NoError(t, err)
	require.True(t, rep.Rotated, "once it ended, the next pass rotates")
	require.Equal(t, int64(1), rep.Generation)
}

func TestTableSizesSumTheGenerations(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.inbox(t, "billing", "k", "done", 1000, 0)
	_, err := tb.cleaner(t, rotating).RunOnce(ctx)
	require.NoError(t, err)
	tb.inbox(t, "billing", "l", "done", 1000, 0)
	require.Len(t, tb.partitions(t), 2)

	sizes, err := retention.TableSizes(ctx, tb.env.Pool, tb.env.Schema)
	require.NoError(t, err)
	var parts int64
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree($1::regclass)`,
		tb.env.Q("txbox_inbox")).Scan(&parts))
	require.Equal(t, "txbox_inbox", sizes[1].Table)
	require.Equal(t, parts, sizes[1].TotalBytes)
	require.Greater(t, sizes[1].TotalBytes, int64(2*8192), "both generations count")
}

// A redriven message's row that comes due in a generation not dropped yet stays there as it was,
// and moves to the current generation when its own is dropped: given the redrive's time as its
// receipt time where it is, it would keep its whole generation alive for another InboxRetention.
func TestARedrivenRowDoesNotKeepItsGenerationAlive(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.inbox(t, "billing", "redriven", "done", 1, 10*day)
	tb.inbox(t, "billing", "young", "done", 1, day)
	tb.redriven(t, "redriven-1", day)

	rep, err := tb.cleaner(t, rotating).RunOnce(ctx)
	require.NoError(t, err)
	require.Empty(t, rep.GenerationsDropped)
	require.Zero(t, rep.RedrivenKept)
	require.Equal(t, []string{"redriven-1", "young-1"}, tb.keys(t, "txbox_inbox", "generation = 0"))

	tb.exec(t, `UPDATE `+tb.env.Q("txbox_inbox")+` SET received_at = now() - interval '9 days' WHERE dedup_key = 'young-1'`)
	rep, err = tb.cleaner(t, retention.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, []int64{0}, rep.GenerationsDropped)
	require.Equal(t, int64(1), rep.GenerationRowsMoved)
	require.Equal(t, []string{"redriven-1"}, tb.keys(t, "txbox_inbox", "generation = 1 AND received_at > now() - interval '25 hours'"))
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "true"))
}

// A rotated generation's primary key arbitrates like generation 0's: concurrent deliveries of one
// message into it run the handler once, and none fails on the key.
func TestConcurrentDeliveriesIntoANewGenerationRunOnce(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	rep, err := tb.cleaner(t, rotating).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(1), rep.Generation)

	c := tb.consumer(t, inbox.Config{MaxAttempts: -1, LockTimeout: -1})
	// The first to insert commits once the other three wait for its row (or after a while: the
	// test then proves less, but still that none runs twice).
	c.hold = func(string) {
		for range 3000 {
			var n int
			err := tb.env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND wait_event = 'transactionid' AND strpos(query, $1) > 0`, tb.env.Schema).Scan(&n)
			if err != nil || n >= 3 {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	errs := make(chan error, 4)
	for range 4 {
		go func() { errs <- c.deliver("m") }()
	}
	for range 4 {
		require.NoError(t, <-errs)
	}
	require.Equal(t, 1, c.runs("m"))
	require.Equal(t, []string{"m"}, tb.keys(t, "txbox_inbox", "generation = 1"))
}

// A detach that was interrupted (the pass stopped while it waited for an old transaction) is
// finished by the next pass, and the detached generation dropped.
func TestAnInterruptedDetachIsFinished(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.inbox(t, "billing", "old", "done", 10, 9*day)
	rep, err := tb.cleaner(t, retention.Config{InboxGeneration: time.Microsecond, BrokerRetention: 364 * day, InboxRetention: 365 * day}).RunOnce(ctx)
	require.NoError(t, err)
	require.Empty(t, rep.GenerationsDropped)

	reader, err := tb.env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer reader.Rollback(ctx) //nolint:errcheck // The test ends it.
	_, err = reader.Exec(ctx, `SELECT count(*) FROM `+tb.env.Q("txbox_inbox"))
	require.NoError(t, err)
	// The detach is interrupted once its first step has committed (the partition is marked pending)
	// and it waits for the reader: a timeout instead would also cut short a first step that a busy
	// server makes slow, leaving nothing pending.
	conn, err := tb.env.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	detach := make(chan error, 1)
	go func() {
		_, err := conn.Exec(ctx, `ALTER TABLE `+tb.env.Q("txbox_inbox")+` DETACH PARTITION `+tb.env.Q("txbox_inbox_g0")+` CONCURRENTLY`)
		detach <- err
	}()
	require.Eventually(t, func() bool {
		var pending bool
		err := tb.env.Pool.QueryRow(ctx, `SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = $1::regclass`,
			tb.env.Q("txbox_inbox_g0")).Scan(&pending)
		return err == nil && pending
	}, 30*time.Second, 5*time.Millisecond, "the detach marks the partition pending, then waits for the reader")
	_, err = tb.env.Pool.Exec(ctx, `SELECT pg_cancel_backend($1)`, conn.Conn().PgConn().PID())
	require.NoError(t, err)
	require.ErrorContains(t, <-detach, "canceling statement due to user request")
	require.NoError(t, reader.Rollback(ctx))

	_, err = tb.cleaner(t, retention.Config{}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"txbox_inbox_g1"}, tb.partitions(t))
	var left bool
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, tb.env.Q("txbox_inbox_g0")).Scan(&left))
	require.False(t, left, "the detached generation is dropped")
}
