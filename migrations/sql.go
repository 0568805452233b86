package migrations

import "github.com/txbox/txbox/internal/sqlname"

// Statements that need no schema.
const (
	currentDatabaseSQL = `SELECT current_database()`
	schemaExistsSQL    = `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)`
	// The lock is held by the migrating session; PostgreSQL releases it if that session dies.
	lockSQL   = `SELECT pg_advisory_lock($1)`
	unlockSQL = `SELECT pg_advisory_unlock($1)`
	// Back to the search_path the connection was opened with, before the connection returns to the
	// caller's pool.
	resetSearchPathSQL = `RESET search_path`
)

// queries are the statements that name the schema, rendered once per provider.
type queries struct {
	createSchema  string
	setSearchPath string
	installed     string
	tablesExist   string
	rowsLeft      string
}

func renderQueries(quotedSchema string) queries {
	return queries{
		createSchema:  sqlname.Render(`CREATE SCHEMA IF NOT EXISTS {schema}`, quotedSchema),
		setSearchPath: sqlname.Render(`SET search_path TO {schema}`, quotedSchema),
		installed:     sqlname.Render(`SELECT to_regclass('{schema}.`+VersionTable+`') IS NOT NULL`, quotedSchema),
		tablesExist:   sqlname.Render(`SELECT to_regclass('{schema}.txbox_outbox') IS NOT NULL AND to_regclass('{schema}.txbox_dlq') IS NOT NULL`, quotedSchema),
		rowsLeft:      sqlname.Render(`SELECT (SELECT count(*) FROM {schema}.txbox_outbox), (SELECT count(*) FROM {schema}.txbox_dlq)`, quotedSchema),
	}
}
