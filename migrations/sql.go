package migrations

import "github.com/txbox/txbox/internal/sqlname"

// Statements that need no schema.
const (
	currentDatabaseSQL = `SELECT current_database()`
	schemaExistsSQL    = `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)`
	// The lock lasts as long as the transaction that takes it, which PostgreSQL ends if its
	// session dies. The transaction waits idle while goose migrates on another connection, so a
	// server-wide idle_in_transaction_session_timeout must not end it.
	lockSQL = `SELECT pg_try_advisory_xact_lock($1)
		FROM (SELECT set_config('idle_in_transaction_session_timeout', '0', true)) AS no_idle_timeout`
	// A migration's statement, or Down's fence, waits this long at most for a lock that a
	// session holds on a table: while it waits, every new write to the table queues behind it,
	// the application's included.
	fenceLockTimeoutSQL = `SELECT set_config('lock_timeout', '` + lockWait + `', true)`
)

const lockWait = "10s"

// downFence names the constraint no new row passes, which Down puts on the outbox and the DLQ
// while it drops them (schemaLock.checkEmpty).
const downFence = "txbox_migrate_down_in_progress"

// queries are the statements that name the schema, rendered once per provider.
type queries struct {
	createSchema string
	// preamble opens each migration's Up and Down (inSchema): the schema, and a bound on how
	// long it waits for a lock.
	preamble    string
	installed   string
	tablesExist string
	rowsLeft    string
	fence       []string
	fenced      string
	lockHolders string
	unfence     []string
}

func renderQueries(quotedSchema string) queries {
	return queries{
		createSchema: sqlname.Render(`CREATE SCHEMA IF NOT EXISTS {schema}`, quotedSchema),
		preamble: sqlname.Render(`SET LOCAL search_path TO {schema};
SET LOCAL lock_timeout = '`+lockWait+`';
`, quotedSchema),
		installed:   sqlname.Render(`SELECT to_regclass('{schema}.`+VersionTable+`') IS NOT NULL`, quotedSchema),
		tablesExist: sqlname.Render(`SELECT to_regclass('{schema}.txbox_outbox') IS NOT NULL AND to_regclass('{schema}.txbox_dlq') IS NOT NULL`, quotedSchema),
		rowsLeft:    sqlname.Render(`SELECT (SELECT count(*) FROM {schema}.txbox_outbox), (SELECT count(*) FROM {schema}.txbox_dlq)`, quotedSchema),
		fence: []string{
			sqlname.Render(`ALTER TABLE {schema}.txbox_outbox ADD CONSTRAINT `+downFence+` CHECK (false) NOT VALID`, quotedSchema),
			sqlname.Render(`ALTER TABLE {schema}.txbox_dlq ADD CONSTRAINT `+downFence+` CHECK (false) NOT VALID`, quotedSchema),
		},
		fenced: sqlname.Render(`SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
			WHERE conname = '`+downFence+`' AND connamespace = to_regnamespace('{schema}'))`, quotedSchema),
		lockHolders: sqlname.Render(`SELECT a.pid, coalesce(a.state, ''), coalesce(a.application_name, ''),
				coalesce(extract(epoch FROM now() - a.xact_start)::bigint, 0)
			FROM pg_catalog.pg_stat_activity AS a
			WHERE a.pid <> pg_backend_pid() AND a.pid IN (SELECT l.pid FROM pg_catalog.pg_locks AS l
				JOIN pg_catalog.pg_class AS c ON c.oid = l.relation
				WHERE l.granted AND c.relnamespace = to_regnamespace('{schema}'))
			ORDER BY a.xact_start`, quotedSchema),
		unfence: []string{
			sqlname.Render(`ALTER TABLE IF EXISTS {schema}.txbox_outbox DROP CONSTRAINT IF EXISTS `+downFence, quotedSchema),
			sqlname.Render(`ALTER TABLE IF EXISTS {schema}.txbox_dlq DROP CONSTRAINT IF EXISTS `+downFence, quotedSchema),
		},
	}
}
