package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/inboxgen"
	"github.com/txbox/txbox/migrations"
	"github.com/txbox/txbox/outbox"
)

// deliverCtx is deliver with the message's context set, as a subscriber sets it.
func deliverCtx(ctx context.Context, h message.HandlerFunc, msg *message.Message) error {
	cp := msg.Copy()
	cp.SetContext(ctx)
	_, err := h(cp)
	return err
}

// flaky fails the handler's first n processings of each message with fail, then lets it apply its
// effect.
func flaky(n int64, fail func(*message.Message) error) func(*message.Message) error {
	var failures atomic.Int64
	return func(msg *message.Message) error {
		if failures.Add(1) <= n {
			return fail(msg)
		}
		return nil
	}
}

// transientFailures delivers msg more times than MaxAttempts (3), each failing for a reason that
// says nothing about the message, then once more: that delivery must process it.
func transientFailures(t *testing.T, b *bundle, h message.HandlerFunc, msg *message.Message, deliverOnce func() error) {
	t.Helper()
	for i := range 5 {
		require.Error(t, deliverOnce(), "delivery %d fails for a transient reason and is retried, not dead-lettered", i+1)
	}
	require.NoError(t, deliver(h, msg))
	require.Zero(t, b.count(t, "txbox_dlq", ""), "a healthy message was dead-lettered")
	require.Equal(t, 1, b.count(t, "effects", "id = $1", msg.UUID))
	require.Equal(t, 1, b.count(t, "txbox_inbox", "state = 'done'"))
}

// Serialization failures, deadlocks and lock timeouts in the handler's business writes are the
// database's, not the message's: they are retried without using up attempts. The errors are the
// real server's, raised with their SQLSTATE.
func TestTransientDatabaseErrorsDoNotUseUpAttempts(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"40001", "40P01", "55P03"} {
		t.Run(code, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil) // MaxAttempts: 3
			h := b.inbox.Middleware(b.handler(flaky(5, func(msg *message.Message) error {
				tx, _ := inbox.TxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), fmt.Sprintf(`DO $$ BEGIN RAISE EXCEPTION 'transient' USING ERRCODE = '%s'; END $$`, code))
				return err
			})))
			msg := newMessage()
			transientFailures(t, b, h, msg, func() error { return deliver(h, msg) })
		})
	}
}

// New handlers are deployed before txbox migrate up ran: the outbox's writes fail on the schema,
// for every message alike. The deliveries are retried without using up attempts, not
// dead-lettered, and the message is processed once the migration is applied.
func TestASchemaLackingAMigrationDoesNotUseUpAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	db := stdlib.OpenDBFromPool(b.env.Pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := migrations.NewProvider(ctx, db, migrations.WithSchema(b.env.Schema))
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 13) // the outbox's check of derived call keys
	require.NoError(t, err)
	w, err := outbox.New(outbox.Config{Schema: b.env.Schema})
	require.NoError(t, err)
	h := b.inbox.Middleware(b.handler(func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := w.Call(msg.Context(), tx, outbox.Call{Name: "charge", Path: "/v1/charges", Params: url.Values{"amount": {"1000"}}})
		return err
	}))
	msg := newMessage()
	deliveries := 0
	transientFailures(t, b, h, msg, func() error {
		err := deliver(h, msg)
		require.ErrorIs(t, err, outbox.ErrSchemaOutdated)
		if deliveries++; deliveries == 5 {
			_, err := migrations.Up(ctx, db, migrations.WithSchema(b.env.Schema))
			require.NoError(t, err)
		}
		return err
	})
	require.Equal(t, 1, b.count(t, "txbox_outbox", "kind = 'call'"))
}

// The handler's connection is lost (its session terminated, as a PostgreSQL restart or a failover
// would) after the handler ran: the inbox's next statement fails, and the attempt is given back.
func TestLostConnectionsDoNotUseUpAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.inbox.Middleware(b.handler(flaky(5, func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		var pid int
		if err := tx.QueryRow(msg.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			return err
		}
		_, err := b.env.Pool.Exec(context.Background(), "SELECT pg_terminate_backend($1)", pid)
		return err // nil: the handler succeeded, its transaction is gone
	})))
	msg := newMessage()
	transientFailures(t, b, h, msg, func() error { return deliver(h, msg) })
}

// Shutdown cancels the message's context while the handler runs: the transaction cannot commit,
// and the attempt is given back.
func TestShutdownDoesNotUseUpAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var cancel context.CancelFunc
	h := b.inbox.Middleware(b.handler(flaky(5, func(*message.Message) error {
		cancel() // the router is stopping
		return nil
	})))
	msg := newMessage()
	transientFailures(t, b, h, msg, func() error {
		var ctx context.Context
		ctx, cancel = context.WithCancel(context.Background())
		defer cancel()
		return deliverCtx(ctx, h, msg)
	})
}

// A stop that cancels a delivery while its opening round trip is on the server, after the crash
// marker committed and before its answer arrived (the generation lock, later in the round trip, is
// held by a retention pass), leaves no unfinished attempt behind: such markers made the message a
// crash suspect at its next delivery, and were charged to it as crashes.
func TestShutdownDuringTheOpeningRoundTripLeavesNoMarker(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.inbox.Middleware(b.handler(nil))
	msg := newMessage()
	lockGenerations := strings.ReplaceAll(inboxgen.RotationLock, "{schema}", pgx.Identifier{b.env.Schema}.Sanitize())
	transientFailures(t, b, h, msg, func() error {
		ctx := context.Background()
		rotation, err := b.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer rotation.Rollback(ctx) //nolint:errcheck // Ends the rotation.
		_, err = rotation.Exec(ctx, lockGenerations)
		require.NoError(t, err)

		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		delivered := make(chan error, 1)
		go func() { delivered <- deliverCtx(ctx, h, msg) }()
		require.Eventually(t, func() bool {
			return b.count(t, "txbox_inbox_attempt", "dedup_key = $1 AND unfinished > 0", msg.UUID) > 0
		}, 10*time.Second, time.Millisecond, "the marker commits while the round trip waits for the lock")
		cancel() // the router is stopping
		time.Sleep(50 * time.Millisecond)
		require.NoError(t, rotation.Rollback(context.Background()))
		err = <-delivered
		require.Zero(t, b.count(t, "txbox_inbox_attempt", "dedup_key = $1 AND unfinished > 0", msg.UUID),
			"the stopped delivery's marker is left behind")
		return err
	})
}

// The pool has no connection free for the handler's transaction before the delivery's deadline.
func TestPoolTimeoutsDoNotUseUpAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	cfg, err := pgxpool.ParseConfig(b.env.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ib, err := inbox.New(inbox.Config{DB: pool, Consumer: "billing", Schema: b.env.Schema, MaxAttempts: 3}, nil)
	require.NoError(t, err)
	h := ib.Middleware(b.handler(nil))
	msg := newMessage()

	transientFailures(t, b, h, msg, func() error {
		// Other work takes every connection between the attempt's count and the transaction, and
		// gives them back just after the delivery's deadline.
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		var releasing sync.WaitGroup
		ctx = failpoint.WithHook(ctx, "inbox.before-begin", func() {
			var held []*pgxpool.Conn
			for range cfg.MaxConns {
				c, err := pool.Acquire(context.Background())
				require.NoError(t, err)
				held = append(held, c)
			}
			releasing.Go(func() {
				<-ctx.Done()
				for _, c := range held {
					c.Release()
				}
			})
		})
		err := deliverCtx(ctx, h, msg)
		releasing.Wait()
		require.ErrorIs(t, err, context.DeadlineExceeded)
		return err
	})
}

// Instance A holds the message (processing it, slowly); instance B's redeliveries give up on its
// lock again and again. Those deliveries never ran the handler: when A's processing then fails,
// the message still has attempts left, and the next delivery processes it.
func TestConcurrentDuplicatesDoNotUseUpAttempts(t *testing.T) {
	t.Parallel()
	bounded := func(c *inbox.Config) { c.LockTimeout, c.MaxAttempts = 100*time.Millisecond, 3 }
	a := setup(t, bounded)
	cfgB := inbox.Config{DB: a.env.Pool, Consumer: "billing", Schema: a.env.Schema}
	bounded(&cfgB)
	b, err := inbox.New(cfgB, nil)
	require.NoError(t, err)

	entered, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	slow := a.inbox.Middleware(a.handler(func(*message.Message) error {
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
			return errors.New("downstream unavailable")
		}
		return nil
	}))
	msg := newMessage()
	aDone := make(chan error, 1)
	go func() { aDone <- deliver(slow, msg) }()
	<-entered
	h := b.Middleware(a.handler(nil))
	for range 5 {
		require.Error(t, deliver(h, msg), "B waits on A's lock and gives up")
	}
	close(release)
	require.ErrorContains(t, <-aDone, "downstream unavailable")

	require.NoError(t, deliver(h, msg))
	require.Zero(t, a.count(t, "txbox_dlq", ""), "one real failure dead-lettered the message")
	require.Equal(t, 1, a.count(t, "effects", "id = $1", msg.UUID))
}
