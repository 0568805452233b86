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
	// A writer holding the outbox or the DLQ in a transaction delays the fence this long at most:
	// while the fence waits for its lock, every new write to the table queues behind it.
	fenceLockTimeoutSQL = `SELECT set_config('lock_timeout', '10s', true)`
)

// downFence names the constraint no new row passes, which Down puts on the outbox and the DLQ
// while it drops them (schemaLock.checkEmpty).
const downFence = "txbox_migrate_down_in_progress"

// queries are the statements that name the schema, rendered once per provider.
type queries struct {
	createSchema  string
	setSearchPath string
	installed     string
	tablesExist   string
	rowsLeft      string
	fence         []string
	fenced        string
	unfence       []string
}

func renderQueries(quotedSchema string) queries {
	return queries{
		createSchema:  sqlname.Render(`CREATE SCHEMA IF NOT EXISTS {schema}`, quotedSchema),
		setSearchPath: sqlname.Render(`SET LOCAL search_path TO {schema}`, quotedSchema),
		installed:     sqlname.Render(`SELECT to_regclass('{schema}.`+VersionTable+`') IS NOT NULL`, quotedSchema),
		tablesExist:   sqlname.Render(`SELECT to_regclass('{schema}.txbox_outbox') IS NOT NULL AND to_regclass('{schema}.txbox_dlq') IS NOT NULL`, quotedSchema),
		rowsLeft:      sqlname.Render(`SELECT (SELECT count(*) FROM {schema}.txbox_outbox), (SELECT count(*) FROM {schema}.txbox_dlq)`, quotedSchema),
		fence: []string{
			sqlname.Render(`ALTER TABLE {schema}.txbox_outbox ADD CONSTRAINT `+downFence+` CHECK (false) NOT VALID`, quotedSchema),
			sqlname.Render(`ALTER TABLE {schema}.txbox_dlq ADD CONSTRAINT `+downFence+` CHECK (false) NOT VALID`, quotedSchema),
		},
		fenced: sqlname.Render(`SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
			WHERE conname = '`+downFence+`' AND connamespace = to_regnamespace('{schema}'))`, quotedSchema),
		unfence: []string{
			sqlname.Render(`ALTER TABLE IF EXISTS {schema}.txbox_outbox DROP CONSTRAINT IF EXISTS `+downFence, quotedSchema),
			sqlname.Render(`ALTER TABLE IF EXISTS {schema}.txbox_dlq DROP CONSTRAINT IF EXISTS `+downFence, quotedSchema),
		},
	}
}
