package migrations_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/migrations"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func open(t *testing.T, url, schema string) *sql.DB {
	t.Helper()
	db, err := sqlname.OpenDB(context.Background(), url, schema)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}

func tables(t *testing.T, db *sql.DB) []string {
	t.Helper()
	rows, err := db.Query(`SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() ORDER BY 1`)
	require.NoError(t, err)
	defer rows.Close()
	var names []string
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		names = append(names, n)
	}
	require.NoError(t, rows.Err())
	return names
}

func TestUpDownUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := open(t, pgtest.NewDatabase(t), "public")

	require.NoError(t, migrations.Up(ctx, db))
	require.Contains(t, tables(t, db), "txbox_outbox")
	require.Contains(t, tables(t, db), "txbox_inbox")
	require.Contains(t, tables(t, db), "txbox_lease")
	require.Contains(t, tables(t, db), migrations.VersionTable)

	require.NoError(t, migrations.Down(ctx, db))
	require.Equal(t, []string{migrations.VersionTable}, tables(t, db), "down leaves only goose's version table")

	require.NoError(t, migrations.Up(ctx, db))
	require.Contains(t, tables(t, db), "txbox_outbox")

	p, err := migrations.NewProvider(ctx, db)
	require.NoError(t, err)
	pending, err := p.HasPending(ctx)
	require.NoError(t, err)
	require.False(t, pending)
}

func TestConcurrentMigrationsTakeTurns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	var g errgroup.Group
	for range 4 {
		db := open(t, url, "txbox") // separate pools: separate sessions, like separate processes
		g.Go(func() error { return migrations.Up(ctx, db) })
	}
	require.NoError(t, g.Wait())
	db := open(t, url, "txbox")
	var applied int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM txbox.`+migrations.VersionTable+` WHERE version_id > 0`).Scan(&applied))
	p, err := migrations.NewProvider(ctx, db)
	require.NoError(t, err)
	sources := p.ListSources()
	require.Equal(t, len(sources), applied, "each migration applied exactly once")
}

func TestSchemaNamesAreValidated(t *testing.T) {
	t.Parallel()
	_, err := sqlname.OpenDB(context.Background(), pgtest.AdminURL(t), `x"; DROP TABLE y; --`)
	require.ErrorContains(t, err, "not a valid name")
}
