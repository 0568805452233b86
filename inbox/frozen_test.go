package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
)

// Instance A freezes inside its handler, holding the message's inbox row (its goroutine blocks, as
// a stopped process or a long pause would: the session sits idle in its transaction). Instance B
// gets the redelivery. B gives up within the lock timeout instead of waiting out A's freeze;
// PostgreSQL ends A's session after the idle timeout, B then processes the message, A's late
// commit fails, and the business effect happens once.
func TestARedeliveryDoesNotWaitForAFrozenPartner(t *testing.T) {
	t.Parallel()
	const (
		lockTimeout = 300 * time.Millisecond
		idleTimeout = 1500 * time.Millisecond
		// margin is what a loaded 2-core machine may add to a bound before the test calls it broken.
		margin = 3 * time.Second
	)
	bounded := func(c *inbox.Config) {
		c.LockTimeout, c.IdleInTransactionTimeout, c.MaxAttempts = lockTimeout, idleTimeout, 50
	}
	a := setup(t, bounded)
	cfgB := inbox.Config{DB: a.env.Pool, Consumer: "billing", Schema: a.env.Schema}
	bounded(&cfgB)
	b, err := inbox.New(cfgB, nil)
	require.NoError(t, err)

	entered, release := make(chan struct{}), make(chan struct{})
	frozen := a.inbox.Middleware(a.handler(func(*message.Message) error {
		close(entered)
		<-release
		return nil
	}))
	msg := newMessage()
	aDone := make(chan error, 1)
	go func() { aDone <- deliver(frozen, msg) }()
	<-entered
	frozenAt := time.Now()
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})

	healthy := b.Middleware(a.handler(nil))
	start := time.Now()
	bDone := make(chan error, 1)
	go func() { bDone <- deliver(healthy, msg) }()
	select {
	case err := <-bDone:
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), "%v", err)
		require.Equal(t, "55P03", pgErr.Code, "lock_not_available: %v", err)
		require.Less(t, time.Since(start), lockTimeout+margin)
	case <-time.After(lockTimeout + 2*margin):
		t.Fatalf("the redelivery waited for the frozen partner for %s", lockTimeout+2*margin)
	}

	// Redelivered until A's session is gone; then B processes it.
	require.Eventually(t, func() bool { return deliver(healthy, msg) == nil }, idleTimeout+2*margin, 50*time.Millisecond)
	require.GreaterOrEqual(t, time.Since(frozenAt), idleTimeout, "B processed the message only once A's session was ended")
	require.Equal(t, 1, a.count(t, "effects", "id = $1", msg.UUID))

	close(release) // A wakes up and goes on to commit, late: its session is gone.
	var ended *pgconn.PgError
	require.ErrorAs(t, <-aDone, &ended)
	require.Equal(t, "25P03", ended.Code, "idle_in_transaction_session_timeout")
	require.NoError(t, deliver(frozen, msg), "A's redelivery is a duplicate")
	require.Equal(t, 1, a.count(t, "effects", "id = $1", msg.UUID), "the business effect happened once")
	require.Equal(t, 1, a.count(t, "txbox_inbox", "dedup_key = $1 AND state = 'done'", msg.UUID))
}

func TestTimeoutsAreValidated(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, c := range []inbox.Config{
		{LockTimeout: time.Microsecond},
		{IdleInTransactionTimeout: 25 * 24 * time.Hour},
	} {
		c.DB, c.Consumer, c.Schema = b.env.Pool, "billing", b.env.Schema
		_, err := inbox.New(c, nil)
		require.ErrorContains(t, err, "Timeout must be between")
	}
	_, err := inbox.New(inbox.Config{DB: b.env.Pool, Consumer: "billing", Schema: b.env.Schema, LockTimeout: -1, IdleInTransactionTimeout: -1}, nil)
	require.NoError(t, err, "negative: no limit")
}

// A handler that freezes on a message every time, past the idle timeout, is like one that crashes:
// each freeze uses up an attempt, and the message reaches the dead-letter table.
func TestAMessageThatFreezesItsHandlerEveryTimeIsDeadLettered(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *inbox.Config) { c.IdleInTransactionTimeout, c.MaxAttempts = 200*time.Millisecond, 2 })
	h := b.inbox.Middleware(b.handler(func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		var pid int
		if err := tx.QueryRow(msg.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			return err
		}
		// Frozen until PostgreSQL has ended the session.
		require.Eventually(t, func() bool {
			var alive bool
			err := b.env.Pool.QueryRow(context.Background(), "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid).Scan(&alive)
			return err == nil && !alive
		}, 10*time.Second, 20*time.Millisecond)
		return nil
	}))
	msg := newMessage()
	for range 2 {
		var ended *pgconn.PgError
		require.ErrorAs(t, deliver(h, msg), &ended)
		require.Equal(t, "25P03", ended.Code)
	}
	require.NoError(t, deliver(h, msg))
	require.Equal(t, 1, b.count(t, "txbox_dlq", "reason = $1", inbox.ReasonAttemptsExhausted))
	require.Zero(t, b.count(t, "effects", ""))
}

// A handler that waits for a lock someone else holds (a batch job, a migration) under a delivery
// deadline shorter than LockTimeout gives its attempts back, as it does without the deadline: the
// wait ends as a lock timeout before the deadline cuts it off. Before, each delivery was cut off by
// the deadline, charged as a slow attempt, and the healthy message was dead-lettered.
func TestALockWaitUnderADeadlineGivesItsAttemptBack(t *testing.T) {
	t.Parallel()
	// MaxAttempts: 3. The deadline below leaves the lock wait a second's slack (a quarter of the
	// time left), which a loaded machine needs: with 300 ms, the statements before the wait could
	// take it all, and the deadline cut the wait off.
	b := setup(t, func(c *inbox.Config) { c.LockTimeout = 10 * time.Second })
	ctx := context.Background()
	_, err := b.env.Pool.Exec(ctx, "INSERT INTO "+b.env.Q("effects")+" VALUES ('account', 0)")
	require.NoError(t, err)
	h := b.inbox.Middleware(b.handler(func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "UPDATE "+b.env.Q("effects")+" SET n = n + 1 WHERE id = 'account'")
		return err
	}))
	holder, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback(ctx) }) // Committed below, unless the test fails first.
	_, err = holder.Exec(ctx, "UPDATE "+b.env.Q("effects")+" SET n = n WHERE id = 'account'")
	require.NoError(t, err)

	msg := newMessage()
	for i := range 3 { // As many as MaxAttempts: charged, they would dead-letter the next delivery.
		ctx, cancel := context.WithTimeout(ctx, 4*time.Second)
		err := deliverCtx(ctx, h, msg)
		cancel()
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, "delivery %d", i+1)
		require.Equal(t, "55P03", pgErr.Code, "delivery %d ends as a lock timeout", i+1)
	}
	require.NoError(t, holder.Commit(ctx))
	require.NoError(t, deliver(h, msg))
	require.Zero(t, b.count(t, "txbox_dlq", ""), "a healthy message is not dead-lettered")
	require.Equal(t, 1, b.count(t, "effects", "id = $1", msg.UUID))
}

// A delivery deadline far away (40 days: a caller's "no real deadline") with LockTimeout negative
// (no limit) bounds lock waits by PostgreSQL's longest lock_timeout: three quarters of the time
// left was over it, PostgreSQL refused the setting, and every delivery failed before its handler.
func TestAFarDeadlineWithoutALockTimeoutIsProcessed(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *inbox.Config) { c.LockTimeout = -1 })
	h := b.inbox.Middleware(b.handler(nil))
	msg := newMessage()
	for _, far := range []time.Duration{40 * 24 * time.Hour, 150 * 365 * 24 * time.Hour} {
		ctx, cancel := context.WithTimeout(context.Background(), far)
		defer cancel()
		require.NoError(t, deliverCtx(ctx, h, msg), far)
	}
	require.Equal(t, 1, b.count(t, "effects", "id = $1", msg.UUID))
	// A century away, the time left times three overflowed, and lock waits were cut to 1 ms.
	var set string
	show := b.inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.TxFromContext(msg.Context())
		return nil, tx.QueryRow(msg.Context(), "SHOW lock_timeout").Scan(&set)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 150*365*24*time.Hour)
	defer cancel()
	require.NoError(t, deliverCtx(ctx, show, newMessage()))
	require.Equal(t, "2147483647ms", set)
}

// A handler too slow on a message every time, its statement cut off by a deadline (the delivery's,
// as a Timeout middleware sets it, or its own), uses up an attempt each time, and the message
// reaches the dead-letter table. pgx closes the connection of a statement a deadline cuts off:
// taken for a lost connection, the attempt was given back, and the message retried for ever.
func TestAMessageWhoseStatementsRunPastTheirDeadlineIsDeadLettered(t *testing.T) {
	t.Parallel()
	// The delivery's deadline is long enough that the opening round trip, which a deadline cutting
	// it off leaves uncharged (the handler never ran), ends before it even under load.
	for name, deadlines := range map[string]struct{ delivery, handler time.Duration }{
		"the delivery's deadline":    {delivery: time.Second},
		"the handler's own deadline": {handler: 200 * time.Millisecond},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil) // MaxAttempts: 3
			h := b.inbox.Middleware(b.handler(func(msg *message.Message) error {
				tx, _ := inbox.TxFromContext(msg.Context())
				ctx := msg.Context()
				if deadlines.handler > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, deadlines.handler)
					defer cancel()
				}
				_, err := tx.Exec(ctx, "SELECT pg_sleep(5)")
				return err
			}))
			deliverSlow := func(h message.HandlerFunc, msg *message.Message) error {
				if deadlines.delivery == 0 {
					return deliver(h, msg)
				}
				ctx, cancel := context.WithTimeout(context.Background(), deadlines.delivery)
				defer cancel()
				return deliverCtx(ctx, h, msg)
			}
			msg := newMessage()
			for i := range 3 {
				require.ErrorIs(t, deliverSlow(h, msg), context.DeadlineExceeded, "delivery %d", i+1)
			}
			require.NoError(t, deliver(h, msg))
			require.Equal(t, 1, b.count(t, "txbox_dlq", "reason = $1", inbox.ReasonAttemptsExhausted))
			require.Zero(t, b.count(t, "effects", ""))
		})
	}
}
