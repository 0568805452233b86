package migrations_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/migrations"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// open returns a pool of its own: separate pools are separate sessions, like separate processes.
func open(t *testing.T, url string) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", url)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}

func tables(t *testing.T, db *sql.DB, schema string) []string {
	t.Helper()
	rows, err := db.Query(`SELECT table_name FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1`, schema)
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

func schemaExists(t *testing.T, db *sql.DB, schema string) bool {
	t.Helper()
	var ok bool
	require.NoError(t, db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&ok))
	return ok
}

func TestUpDownUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := open(t, pgtest.NewDatabase(t))
	in := migrations.WithSchema("txbox")

	applied, err := migrations.Up(ctx, db, in)
	require.NoError(t, err)
	require.NotEmpty(t, applied)
	require.Contains(t, tables(t, db, "txbox"), "txbox_outbox")
	require.Contains(t, tables(t, db, "txbox"), "txbox_inbox")
	require.Contains(t, tables(t, db, "txbox"), "txbox_lease")
	require.Contains(t, tables(t, db, "txbox"), migrations.VersionTable)
	require.NotContains(t, tables(t, db, "public"), migrations.VersionTable, "nothing lands in the connection's own search_path")

	again, err := migrations.Up(ctx, db, in)
	require.NoError(t, err)
	require.Empty(t, again)
	token := func() int64 {
		var n int64
		require.NoError(t, db.QueryRowContext(ctx, "SELECT nextval('txbox.txbox_lease_token')").Scan(&n))
		return n
	}
	before := token()

	rolledBack, err := migrations.Down(ctx, db, in)
	require.NoError(t, err)
	require.Len(t, rolledBack, len(applied))
	require.Equal(t, []string{migrations.VersionTable}, tables(t, db, "txbox"), "down leaves only goose's version table")

	_, err = migrations.Up(ctx, db, in)
	require.NoError(t, err)
	require.Contains(t, tables(t, db, "txbox"), "txbox_outbox")
	// The lease tokens of the outbox made anew go on from the last ones, never back: consumers that
	// saw the earlier tokens would count every message of lower ones as superseded.
	require.Greater(t, token(), before, "a token of the outbox made anew is above every earlier one")

	// The goose Provider, for callers who want it; HasPending takes no lock and runs without the
	// search_path, so it relies on the qualified version table.
	p, err := migrations.NewProvider(ctx, db, in)
	require.NoError(t, err)
	pending, err := p.HasPending(ctx)
	require.NoError(t, err)
	require.False(t, pending)
}

// Several processes installing txbox into a schema that does not exist yet take turns: the schema
// is created under the migration lock. Before, each created it first and most rounds failed with
// a duplicate key on pg_namespace.
func TestConcurrentUpOnANewSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	for round := range 5 {
		schema := fmt.Sprintf("fresh_%d", round)
		var g errgroup.Group
		for range 4 {
			db := open(t, url)
			g.Go(func() error {
				_, err := migrations.Up(ctx, db, migrations.WithSchema(schema))
				return err
			})
		}
		require.NoError(t, g.Wait(), "round %d", round)
		db := open(t, url)
		var applied int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM `+schema+`.`+migrations.VersionTable+` WHERE version_id > 0`).Scan(&applied))
		p, err := migrations.NewProvider(ctx, db, migrations.WithSchema(schema))
		require.NoError(t, err)
		require.Len(t, p.ListSources(), applied, "each migration applied exactly once")
	}
}

// Status and Down never create anything: a mistyped schema is an error, not a new empty schema.
func TestStatusAndDownNeedAnInstalledSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := open(t, pgtest.NewDatabase(t))
	typo := migrations.WithSchema("txbx")

	_, err := migrations.Status(ctx, db, typo)
	require.ErrorIs(t, err, migrations.ErrSchemaNotFound)
	_, err = migrations.Down(ctx, db, typo)
	require.ErrorIs(t, err, migrations.ErrSchemaNotFound)
	_, err = migrations.Down(ctx, db, typo, migrations.WithForce())
	require.ErrorIs(t, err, migrations.ErrSchemaNotFound)
	require.False(t, schemaExists(t, db, "txbx"))

	// A schema of the application's, where txbox was never installed: every migration is pending,
	// and goose's version table is not created.
	_, err = db.Exec(`CREATE SCHEMA app`)
	require.NoError(t, err)
	st, err := migrations.Status(ctx, db, migrations.WithSchema("app"))
	require.NoError(t, err)
	require.NotEmpty(t, st)
	for _, s := range st {
		require.Equal(t, goose.StatePending, s.State)
	}
	_, err = migrations.Down(ctx, db, migrations.WithSchema("app"))
	require.ErrorIs(t, err, migrations.ErrNotInstalled)
	require.Empty(t, tables(t, db, "app"))
}

func TestDownRefusesWhileMessagesRemain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := open(t, pgtest.NewDatabase(t))
	in := migrations.WithSchema("txbox")
	_, err := migrations.Up(ctx, db, in)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO txbox.txbox_outbox (kind, slot, topic, partition_key, uuid, payload) VALUES ('message', 0, 't', 'k', 'u-1', '')`)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO txbox.txbox_dlq (source, kind, topic, uuid, payload, reason) SELECT 'relay', 'message', 't', 'u-' || g, '', 'r' FROM generate_series(1, 2) g`)
	require.NoError(t, err)

	_, err = migrations.Down(ctx, db, in)
	var notEmpty *migrations.NotEmptyError
	require.ErrorAs(t, err, &notEmpty)
	require.Equal(t, migrations.NotEmptyError{Schema: "txbox", OutboxRows: 1, DeadLetters: 2}, *notEmpty)
	require.Contains(t, tables(t, db, "txbox"), "txbox_outbox", "nothing was dropped")

	_, err = migrations.Down(ctx, db, in, migrations.WithForce())
	require.NoError(t, err)
	require.Equal(t, []string{migrations.VersionTable}, tables(t, db, "txbox"))
}

// The search_path goose needs is set in each migration's transaction only: the caller's
// connections keep theirs. A pool of one connection, which the lock's second connection cannot
// come from, is refused up front rather than left waiting for itself.
func TestMigratingLeavesTheConnectionsAsTheyWere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := open(t, pgtest.NewDatabase(t))
	db.SetMaxOpenConns(1)
	_, err := migrations.Up(ctx, db, migrations.WithSchema("txbox"))
	require.ErrorContains(t, err, "SetMaxOpenConns(1)")

	db.SetMaxOpenConns(2)
	db.SetMaxIdleConns(2)
	var before string
	require.NoError(t, db.QueryRow(`SHOW search_path`).Scan(&before))
	_, err = migrations.Up(ctx, db, migrations.WithSchema("txbox"))
	require.NoError(t, err)
	_, err = migrations.Status(ctx, db, migrations.WithSchema("nope"))
	require.ErrorIs(t, err, migrations.ErrSchemaNotFound)
	for range 2 { // both connections, the one goose migrated on and the one that held the lock
		conn, err := db.Conn(ctx)
		require.NoError(t, err)
		defer conn.Close()
		var after string
		var locks int
		require.NoError(t, conn.QueryRowContext(ctx, `SELECT current_setting('search_path'),
			(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())`).Scan(&after, &locks))
		require.Equal(t, before, after)
		require.Zero(t, locks, "no advisory lock stays on the connection")
	}
}

// Through PgBouncer in transaction mode, where consecutive transactions of one client may run on
// different server connections and nothing a transaction sets on its session outlives it, every
// table still lands in the schema, concurrent installs still take turns, and Down finds what Up
// made. With the lock and search_path on the session, the unlock failed ("the session did not
// hold the lock") on a server connection that never held it, and a migration could have run with
// the pooler's default search_path.
func TestMigratingThroughATransactionPooler(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct := pgtest.NewDatabase(t)
	pooled := pgtest.ThroughPgBouncer(t, direct)
	var g errgroup.Group
	for range 3 {
		db := open(t, pooled)
		g.Go(func() error {
			_, err := migrations.Up(ctx, db, migrations.WithSchema("txbox"))
			return err
		})
	}
	require.NoError(t, g.Wait())

	db := open(t, direct)
	require.Contains(t, tables(t, db, "txbox"), "txbox_outbox")
	require.Contains(t, tables(t, db, "txbox"), "txbox_inbox")
	require.Empty(t, tables(t, db, "public"), "nothing lands in the server's default schema")
	var applied int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM txbox.`+migrations.VersionTable+` WHERE version_id > 0`).Scan(&applied))
	require.Len(t, sources(t, db), applied, "each migration applied exactly once")

	through := open(t, pooled)
	st, err := migrations.Status(ctx, through, migrations.WithSchema("txbox"))
	require.NoError(t, err)
	for _, s := range st {
		require.Equal(t, goose.StateApplied, s.State, s.Source.Path)
	}
	_, err = through.Exec(`INSERT INTO txbox.txbox_outbox (kind, slot, topic, partition_key, uuid, payload) VALUES ('message', 0, 't', '', 'u', '')`)
	require.NoError(t, err)
	var notEmpty *migrations.NotEmptyError
	_, err = migrations.Down(ctx, through, migrations.WithSchema("txbox"))
	require.ErrorAs(t, err, &notEmpty)
	_, err = migrations.Down(ctx, through, migrations.WithSchema("txbox"), migrations.WithForce())
	require.NoError(t, err)
	require.Equal(t, []string{migrations.VersionTable}, tables(t, db, "txbox"))
}

func sources(t *testing.T, db *sql.DB) []*goose.Source {
	t.Helper()
	p, err := migrations.NewProvider(context.Background(), db, migrations.WithSchema("txbox"))
	require.NoError(t, err)
	return p.ListSources()
}

func TestSchemaNamesAreValidated(t *testing.T) {
	t.Parallel()
	db := open(t, pgtest.AdminURL(t))
	for _, name := range []string{`x"; DROP TABLE y; --`, "information_schema", "pg_catalog", "pg_toast", "select", "user"} {
		_, err := migrations.Up(context.Background(), db, migrations.WithSchema(name))
		require.Error(t, err, name)
	}
	require.False(t, schemaExists(t, db, "select"), "a refused name is refused before anything is created")

	// Every word this server will not take as an unquoted schema name is refused up front, not
	// after the schema was created, when goose meets its version table's name.
	rows, err := db.Query(`SELECT word FROM pg_get_keywords() WHERE catcode IN ('R', 'T')`)
	require.NoError(t, err)
	defer rows.Close()
	var words int
	for rows.Next() {
		var word string
		require.NoError(t, rows.Scan(&word))
		_, err := sqlname.Schema(word)
		require.ErrorContains(t, err, "reserves", word)
		words++
	}
	require.NoError(t, rows.Err())
	require.Greater(t, words, 50)
}

// A nil db is an error, from every entry point, not a panic.
func TestANilDBIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, err := migrations.Up(ctx, nil)
	require.ErrorContains(t, err, "db is nil")
	_, err = migrations.Down(ctx, nil)
	require.ErrorContains(t, err, "db is nil")
	_, err = migrations.Status(ctx, nil)
	require.ErrorContains(t, err, "db is nil")
	_, err = migrations.NewProvider(ctx, nil)
	require.ErrorContains(t, err, "db is nil")
}

// WithSchema("") means the default schema, as an empty Config.Schema does everywhere else.
func TestEmptySchemaIsTheDefault(t *testing.T) {
	t.Parallel()
	db := open(t, pgtest.NewDatabase(t))
	_, err := migrations.Up(context.Background(), db, migrations.WithSchema(""))
	require.NoError(t, err)
	require.Contains(t, tables(t, db, sqlname.DefaultSchema), "txbox_outbox")
	_, err = migrations.Status(context.Background(), db, migrations.WithSchema(""))
	require.NoError(t, err)
}

// The inbox becomes generation 0 of the partitioned inbox with its rows, and the prepared
// column, constraint and index (the large-inbox path in 00011's header) are used as they are; a
// rollback keeps every message once.
func TestInboxGenerationsKeepTheRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := open(t, pgtest.NewDatabase(t))
	in := migrations.WithSchema("txbox")
	p, err := migrations.NewProvider(ctx, db, in)
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 9)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO txbox.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state)
		VALUES ('billing', 'k1', '', 'u1', 'orders', 'done'), ('billing', 'k2', 'charge', 'u2', 'orders', 'dead')`)
	require.NoError(t, err)
	for _, prepare := range []string{
		`ALTER TABLE txbox.txbox_inbox ADD COLUMN generation bigint NOT NULL DEFAULT 0`,
		`ALTER TABLE txbox.txbox_inbox ADD CONSTRAINT txbox_inbox_g0_generation CHECK (generation = 0) NOT VALID`,
		`ALTER TABLE txbox.txbox_inbox VALIDATE CONSTRAINT txbox_inbox_g0_generation`,
		`CREATE UNIQUE INDEX CONCURRENTLY txbox_inbox_g0_pkey ON txbox.txbox_inbox (consumer, dedup_key, handler, generation)`,
	} {
		_, err = db.Exec(prepare)
		require.NoError(t, err, prepare)
	}

	_, err = p.UpTo(ctx, 11)
	require.NoError(t, err)
	var parts []string
	rows, err := db.Query(`SELECT relid::regclass::text || ':' || (SELECT count(*) FROM txbox.txbox_inbox WHERE tableoid = relid)
		FROM pg_partition_tree('txbox.txbox_inbox') WHERE isleaf`)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		parts = append(parts, s)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"txbox.txbox_inbox_g0:2"}, parts)
	var indexes string
	require.NoError(t, db.QueryRow(`SELECT string_agg(indexrelid::regclass::text, ',' ORDER BY indexrelid::regclass::text) FROM pg_index
		WHERE indrelid = 'txbox.txbox_inbox_g0'::regclass`).Scan(&indexes))
	require.Equal(t, "txbox.txbox_inbox_g0_pkey,txbox.txbox_inbox_g0_received_at", indexes,
		"generation 0's indexes are the prepared ones, and the only unique one is the primary key's")
	_, err = db.Exec(`INSERT INTO txbox.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic) VALUES ('billing', 'k1', '', 'u1', 'orders')`)
	require.ErrorContains(t, err, "duplicate key", "the primary key holds in generation 0")

	// A message in two generations (a move whose drop did not happen) comes back once.
	_, err = db.Exec(`UPDATE txbox.txbox_inbox_generation SET generation = 1`)
	require.NoError(t, err)
	_, err = db.Exec(`CREATE TABLE txbox.txbox_inbox_g1 PARTITION OF txbox.txbox_inbox FOR VALUES IN (1)`)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO txbox.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state) VALUES ('billing', 'k2', 'charge', 'u2', 'orders', 'dead')`)
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 9)
	require.NoError(t, err)
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM txbox.txbox_inbox`).Scan(&n))
	require.Equal(t, 2, n)
}

// A schema migrated by the version of commit 7713864 holds 00009 but not 00008, which a branch
// numbered before it and merged after it. Before, Up refused it ("detected 1 missing
// (out-of-order) migration lower than database version (9): version 8"), and every other txbox
// command asked for that Up.
func TestUpAppliesAMigrationMergedAfterALaterOne(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := open(t, pgtest.NewDatabase(t))
	in := migrations.WithSchema("txbox")
	p, err := migrations.NewProvider(ctx, db, in)
	require.NoError(t, err)
	for _, v := range []int64{1, 2, 3, 4, 7, 9} {
		_, err := p.ApplyVersion(ctx, v, true)
		require.NoError(t, err, "version %d", v)
	}

	applied, err := migrations.Up(ctx, db, in)
	require.NoError(t, err)
	var versions []int64
	for _, r := range applied {
		versions = append(versions, r.Source.Version)
	}
	require.Equal(t, int64(8), versions[0], "the missing migration is applied first")
	st, err := migrations.Status(ctx, db, in)
	require.NoError(t, err)
	for _, s := range st {
		require.Equal(t, goose.StateApplied, s.State, "version %d", s.Source.Version)
	}
	var idx bool
	require.NoError(t, db.QueryRow(`SELECT to_regclass('txbox.txbox_outbox_call_order') IS NOT NULL`).Scan(&idx))
	require.True(t, idx, "00008's index exists")
}

// Down drops no row that anyone committed: a writer whose transaction is open when Down starts,
// and commits while Down waits for it, keeps its row, and Down is refused. Before, Down counted the
// rows, found none, and dropped the one committed meanwhile with its table (an upgrade audit lost
// two messages in each of three rounds of "until txbox migrate down; do :; done" beside a
// producer).
func TestDownDropsNoRowCommittedWhileItRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	db, writer := open(t, url), open(t, url)
	in := migrations.WithSchema("txbox")
	_, err := migrations.Up(ctx, db, in)
	require.NoError(t, err)

	tx, err := writer.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	_, err = tx.Exec(`INSERT INTO txbox.txbox_outbox (kind, slot, topic, partition_key, uuid, payload) VALUES ('message', 0, 't', 'k', 'u-1', '')`)
	require.NoError(t, err)
	done := downWaitingFor(t, ctx, db, writer, "txbox_outbox", "Down waits for the writer's transaction")
	require.NoError(t, tx.Commit())

	var notEmpty *migrations.NotEmptyError
	require.ErrorAs(t, <-done, &notEmpty)
	require.EqualValues(t, 1, notEmpty.OutboxRows)
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM txbox.txbox_outbox`).Scan(&n))
	require.Equal(t, 1, n, "the row committed while Down ran is kept")
	require.NoError(t, insertOutboxRow(writer, "u-2"), "a refused Down leaves writes welcome")
}

// While Down drops the tables, writes fail on a constraint that says why. A Down stopped there
// (killed, say) leaves the constraint: the next Up removes it, and so does a Down refused for rows
// written before it.
func TestUpRemovesTheFenceOfAStoppedDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := open(t, pgtest.NewDatabase(t))
	in := migrations.WithSchema("txbox")
	_, err := migrations.Up(ctx, db, in)
	require.NoError(t, err)
	insert := func(uuid string) error { return insertOutboxRow(db, uuid) }
	fence := func() {
		for _, table := range []string{"txbox_outbox", "txbox_dlq"} {
			_, err := db.Exec(`ALTER TABLE txbox.` + table + ` ADD CONSTRAINT txbox_migrate_down_in_progress CHECK (false) NOT VALID`)
			require.NoError(t, err)
		}
	}

	fence() // as a Down stopped between its fence and the drop leaves it
	require.ErrorContains(t, insert("u-1"), "txbox_migrate_down_in_progress")
	_, err = migrations.Up(ctx, db, in)
	require.NoError(t, err)
	require.NoError(t, insert("u-1"), "Up removed the fence")

	fence()
	var notEmpty *migrations.NotEmptyError
	_, err = migrations.Down(ctx, db, in)
	require.ErrorAs(t, err, &notEmpty)
	require.NoError(t, insert("u-2"), "the refused Down removed the fence")
}

// A migration waits a bounded time for a lock a session holds on its table, since every write
// to the table queues behind the waiting migration, and its error names the sessions that hold
// locks. Before, an upgrade audit's migrate up waited for a session idle in a transaction for as
// long as it lived (19 s), the producers' inserts queued behind it, printing nothing.
func TestAMigrationWaitsABoundedTimeForALockAndNamesWhoHoldsIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDatabase(t)
	db, reader := open(t, url), open(t, url)
	in := migrations.WithSchema("txbox")
	p, err := migrations.NewProvider(ctx, db, in)
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 9) // 00010 alters txbox_outbox
	require.NoError(t, err)

	idle, err := reader.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = idle.Rollback() }()
	var pid int
	require.NoError(t, idle.QueryRow(`SELECT pg_backend_pid() FROM (SELECT count(*) FROM txbox.txbox_outbox) AS n`).Scan(&pid))

	bounded, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_, err = migrations.Up(bounded, db, in)
	require.Error(t, err)
	require.NoError(t, bounded.Err(), "Up gave up on the lock by itself")
	require.ErrorContains(t, err, fmt.Sprintf("pid %d (idle in transaction", pid))
	require.NoError(t, idle.Rollback())
	_, err = migrations.Up(ctx, db, in)
	require.NoError(t, err, "once the session has ended")
}

// fencedWhileWaiting starts Down beside a session that holds a lock on txbox_relay_node (which the
// first migration Down rolls back alters) and returns once Down has fenced the outbox and waits for
// that lock, with the holding session and Down's result.
func fencedWhileWaiting(t *testing.T, ctx context.Context, url string) (holder *sql.Tx, down <-chan error) {
	t.Helper()
	db, other := open(t, url), open(t, url)
	in := migrations.WithSchema("txbox")
	_, err := migrations.Up(context.Background(), db, in)
	require.NoError(t, err)
	holder, err = other.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = holder.Rollback() })
	_, err = holder.Exec(`SELECT count(*) FROM txbox.txbox_relay_node`)
	require.NoError(t, err)
	return holder, downWaitingFor(t, ctx, db, other, "txbox_relay_node", "Down fenced the outbox and waits for the holder's lock")
}

// downWaitingFor starts Down of schema txbox on db and returns, with Down's result to come, once
// a session waits for a lock on table (looked up through watcher, another pool).
func downWaitingFor(t *testing.T, ctx context.Context, db, watcher *sql.DB, table, why string) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		_, err := migrations.Down(ctx, db, migrations.WithSchema("txbox"))
		done <- err
	}()
	require.Eventually(t, func() bool {
		var waiting bool
		require.NoError(t, watcher.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted AND relation = $1::regclass)`, "txbox."+table).Scan(&waiting))
		return waiting
	}, time.Minute, 10*time.Millisecond, why)
	return done
}

func insertOutboxRow(db *sql.DB, uuid string) error {
	_, err := db.Exec(`INSERT INTO txbox.txbox_outbox (kind, slot, topic, partition_key, uuid, payload) VALUES ('message', 0, 't', 'k', $1, '')`, uuid)
	return err
}

// A Down stopped through its context (txbox migrate down's Ctrl-C or SIGTERM) while a migration
// waits for a lock has dropped nothing: it removes its fence all the same. Before, the removal ran
// on the cancelled context and failed, and every write to the outbox failed on the fence until
// someone ran migrate up.
func TestADownStoppedWhileItWaitsForALockRemovesItsFence(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, down := fencedWhileWaiting(t, ctx, url)
	writer := open(t, url)
	require.ErrorContains(t, insertOutboxRow(writer, "u-1"), "txbox_migrate_down_in_progress", "Down is under way")
	cancel()
	require.ErrorIs(t, <-down, context.Canceled)
	require.NoError(t, insertOutboxRow(writer, "u-2"), "the stopped Down removed its fence")
}

// Down's removal of its fence after a failed migration waits a bounded time for the outbox's lock
// too: a session that read the outbox after the fence went up, and sits in its transaction, would
// otherwise hold Down (and every write and read of the outbox, queued behind the removal) for as
// long as it lives. The error says that the fence stays and what removes it.
func TestADownThatFailsRemovesItsFenceWithinABoundedWait(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDatabase(t)
	bounded, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	holder, down := fencedWhileWaiting(t, bounded, url)
	_, err := holder.Exec(`SELECT count(*) FROM txbox.txbox_outbox`)
	require.NoError(t, err, "the fence is committed: reads go on")
	err = <-down
	require.NoError(t, bounded.Err(), "Down gave up by itself")
	require.ErrorContains(t, err, "lock timeout")
	require.ErrorContains(t, err, "migrate up removes it")
	require.NoError(t, holder.Rollback())
	db := open(t, url)
	_, err = migrations.Up(context.Background(), db, migrations.WithSchema("txbox"))
	require.NoError(t, err)
	require.NoError(t, insertOutboxRow(db, "u-1"), "Up removed the fence")
}
