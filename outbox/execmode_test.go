package outbox_test

import (
	"context"
	"database/sql"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

// writeSample writes one message (a plain INSERT), two (arrays) and a call through tx.
func writeSample(t *testing.T, env *txtest.Env, tx outbox.Execer) {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	one := outbox.SetPartitionKey(message.NewMessage("m-1", []byte("one")), "order-1")
	one.Metadata.Set("customer", "c-9")
	require.NoError(t, w.Publish(ctx, tx, "orders", one))
	require.NoError(t, w.Publish(ctx, tx, "orders",
		outbox.SetPartitionKey(message.NewMessage("m-2", []byte("two")), "order-1"),
		message.NewMessage("m-3", nil)))
	c := charge("")
	c.IdempotencyKey = "order-1-charge"
	c.Metadata = map[string]string{"order": "order-1"}
	_, err = w.Call(ctx, tx, c)
	require.NoError(t, err)
}

// sampleRows reads back what writeSample wrote, and empties the outbox for the next write.
func sampleRows(t *testing.T, env *txtest.Env) []row {
	t.Helper()
	ctx := context.Background()
	var callMeta string
	require.NoError(t, env.Pool.QueryRow(ctx, "SELECT metadata FROM "+env.Q("txbox_outbox")+
		" WHERE kind = 'call' AND idempotency_key = 'order-1-charge'").Scan(&callMeta))
	require.JSONEq(t, `{"order":"order-1"}`, callMeta)
	got := rows(t, env)
	_, err := env.Pool.Exec(ctx, "DELETE FROM "+env.Q("txbox_outbox"))
	require.NoError(t, err)
	return got
}

// pgx can run statements five ways (default_query_exec_mode; PgBouncer in transaction mode needs
// exec or simple_protocol), through pgx or through database/sql. Every way stores the same rows:
// in the simple protocol and exec modes pgx sends a []byte as bytea, and the metadata, a text
// column, held the hex of its JSON until the outbox passed it as a string.
func TestEveryWayOfRunningStatementsStoresTheSameRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := txtest.New(t)
	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	writeSample(t, env, tx)
	require.NoError(t, tx.Commit(ctx))
	want := sampleRows(t, env)
	require.Len(t, want, 3)
	require.Equal(t, "c-9", want[0].metadata["customer"])
	require.Equal(t, "order-1", want[1].metadata[outbox.PartitionKeyMetadata])

	for _, mode := range []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
		pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	} {
		cfg, err := pgxpool.ParseConfig(env.URL)
		require.NoError(t, err)
		cfg.ConnConfig.DefaultQueryExecMode = mode
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)

		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		writeSample(t, env, tx)
		require.NoError(t, tx.Commit(ctx))
		require.Equal(t, want, sampleRows(t, env), "pgx, %v", mode)

		db := stdlib.OpenDBFromPool(pool)
		sqlTx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		writeSample(t, env, outbox.FromSQL(sqlTx))
		require.NoError(t, sqlTx.Commit())
		require.Equal(t, want, sampleRows(t, env), "database/sql, %v", mode)
		require.NoError(t, db.Close())
	}
}

// openSQL opens env's database the way a service on database/sql does, through pgx's driver.
func openSQL(t *testing.T, env *txtest.Env) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", env.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// A service on database/sql writes in its own transaction: nothing of a rolled-back one stays.
func TestDatabaseSQLWritesInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := txtest.New(t)
	db := openSQL(t, env)
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	writeSample(t, env, outbox.FromSQL(tx))
	require.NoError(t, tx.Rollback())
	var n int
	require.NoError(t, env.Pool.QueryRow(ctx, "SELECT count(*) FROM "+env.Q("txbox_outbox")).Scan(&n))
	require.Zero(t, n, "gone with the rollback")
}

// flipCtx is live for the first look at Done and cancelled from the second on. database/sql takes
// the first look itself, before it hands the statement to pgx's driver; the cancellation then lands
// in the driver, before the statement is sent — the window in which the driver says "bad
// connection" rather than "cancelled".
type flipCtx struct {
	context.Context
	looked atomic.Bool
}

func (c *flipCtx) Done() <-chan struct{} {
	if !c.looked.Swap(true) {
		return nil
	}
	done := make(chan struct{})
	close(done)
	return done
}

func (c *flipCtx) Err() error {
	if c.looked.Load() {
		return context.Canceled
	}
	return nil
}

// A service that branches on context.Canceled sees it through database/sql too, for messages and
// calls alike, and not only when database/sql notices the cancellation before the driver does.
func TestDatabaseSQLReportsACancelledContextAsCancelled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := txtest.New(t)
	db := openSQL(t, env)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)

	for name, write := range map[string]func(tx outbox.Execer, ctx context.Context) error{
		"publish": func(tx outbox.Execer, ctx context.Context) error {
			return w.Publish(ctx, tx, "orders", message.NewMessage("m-1", nil))
		},
		"call": func(tx outbox.Execer, ctx context.Context) error {
			c := charge("")
			c.IdempotencyKey = "order-1-charge"
			_, err := w.Call(ctx, tx, c)
			return err
		},
	} {
		t.Run(name, func(t *testing.T) {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			require.ErrorIs(t, write(outbox.FromSQL(tx), &flipCtx{Context: ctx}), context.Canceled)
		})
	}
}
