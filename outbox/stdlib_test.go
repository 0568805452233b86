package outbox_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

// A service on database/sql writes the same rows as one on pgx, in its own transaction: one
// message (a plain INSERT), several (arrays, which only pgx's driver passes through) and a call.
func TestDatabaseSQLWritesWhatPgxWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	write := func(t *testing.T, env *txtest.Env, tx outbox.Execer) {
		t.Helper()
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
		_, err = w.Call(ctx, tx, c)
		require.NoError(t, err)
	}
	written := func(t *testing.T, env *txtest.Env) []row {
		t.Helper()
		var calls int
		require.NoError(t, env.Pool.QueryRow(ctx, "SELECT count(*) FROM "+env.Q("txbox_outbox")+
			" WHERE kind = 'call' AND idempotency_key = 'order-1-charge'").Scan(&calls))
		require.Equal(t, 1, calls)
		return rows(t, env)
	}

	viaPgx := txtest.New(t)
	tx, err := viaPgx.Pool.Begin(ctx)
	require.NoError(t, err)
	write(t, viaPgx, tx)
	require.NoError(t, tx.Commit(ctx))
	want := written(t, viaPgx)
	require.Len(t, want, 3)

	viaSQL := txtest.New(t)
	db, err := sql.Open("pgx", viaSQL.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })

	sqlTx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	write(t, viaSQL, outbox.FromSQL(sqlTx))
	require.NoError(t, sqlTx.Rollback())
	require.Empty(t, rows(t, viaSQL), "gone with the rollback")

	sqlTx, err = db.BeginTx(ctx, nil)
	require.NoError(t, err)
	write(t, viaSQL, outbox.FromSQL(sqlTx))
	require.NoError(t, sqlTx.Commit())
	require.Equal(t, want, written(t, viaSQL))
}
