// Package sqlname validates and quotes the schema name that txbox's SQL is qualified with, and
// renders SQL templates with it, so no caller-supplied identifier reaches SQL unchecked.
package sqlname

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// DefaultSchema is the schema txbox uses when none is configured.
const DefaultSchema = "public"

var identifier = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// Schema checks a schema name and returns it quoted for SQL. An empty name means DefaultSchema.
// Only lower-case, unquoted-style identifiers are accepted: they mean the same thing quoted or not,
// so the name in a connection string's search_path and the name in txbox's SQL can never disagree.
func Schema(name string) (string, error) {
	if name == "" {
		name = DefaultSchema
	}
	if !identifier.MatchString(name) {
		return "", fmt.Errorf("schema %q is not a valid name: use 1-63 lower-case letters, digits and underscores, not starting with a digit", name)
	}
	return pgx.Identifier{name}.Sanitize(), nil
}

// Render replaces every {schema} in a SQL template with the quoted schema name.
func Render(template, quotedSchema string) string {
	return strings.ReplaceAll(template, "{schema}", quotedSchema)
}

// OpenDB opens a database/sql handle on dsn whose sessions use schema as their search_path, creating
// the schema first when it does not exist. It is how migrations are pointed at a schema.
func OpenDB(ctx context.Context, dsn, schema string) (*sql.DB, error) {
	quoted, err := Schema(schema)
	if err != nil {
		return nil, err
	}
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	if schema == "" {
		schema = DefaultSchema
	}
	cfg.RuntimeParams["search_path"] = schema
	db := stdlib.OpenDB(*cfg)
	if _, err := db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+quoted); err != nil {
		db.Close()
		return nil, fmt.Errorf("create schema %s: %w", quoted, err)
	}
	return db, nil
}
