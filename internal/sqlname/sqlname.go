// Package sqlname validates and quotes the schema name that txbox's SQL is qualified with, and
// renders SQL templates with it, so no caller-supplied identifier reaches SQL unchecked.
package sqlname

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
)

// DefaultSchema is the schema txbox uses when none is configured.
const DefaultSchema = "public"

var identifier = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// reserved are the words PostgreSQL will not take unquoted as a schema name (pg_get_keywords()
// categories R and T, as of PostgreSQL 15, and system_user, reserved since 16).
var reserved = map[string]bool{}

func init() {
	for _, w := range strings.Fields(`all analyse analyze and any array as asc asymmetric authorization binary
		both case cast check collate collation column concurrently constraint create cross current_catalog
		current_date current_role current_schema current_time current_timestamp current_user default
		deferrable desc distinct do else end except false fetch for foreign freeze from full grant group
		having ilike in initially inner intersect into is isnull join lateral leading left like limit
		localtime localtimestamp natural not notnull null offset on only or order outer overlaps placing
		primary references returning right select session_user similar some symmetric system_user table
		tablesample then to trailing true union unique user using variadic verbose when where window with`) {
		reserved[w] = true
	}
}

// Schema checks a schema name and returns it quoted for SQL. An empty name means DefaultSchema.
// Only lower-case, unquoted-style identifiers are accepted: they mean the same thing quoted or not,
// so the name in a connection string's search_path and the name in txbox's SQL can never disagree.
// For the same reason words PostgreSQL reserves are refused (goose, which installs the schema,
// names its version table unquoted). PostgreSQL's own schemas (pg_catalog, pg_toast, any pg_*,
// information_schema) are refused.
func Schema(name string) (string, error) {
	if name == "" {
		name = DefaultSchema
	}
	if !identifier.MatchString(name) {
		return "", fmt.Errorf("schema %q is not a valid name: use 1-63 lower-case letters, digits and underscores, not starting with a digit", name)
	}
	if reserved[name] {
		return "", fmt.Errorf("schema %q is a word PostgreSQL reserves: choose another name", name)
	}
	if strings.HasPrefix(name, "pg_") || name == "information_schema" {
		return "", fmt.Errorf("schema %q is one of PostgreSQL's system schemas: choose a schema of your own", name)
	}
	return pgx.Identifier{name}.Sanitize(), nil
}

// Render replaces every {schema} in a SQL template with the quoted schema name.
func Render(template, quotedSchema string) string {
	return strings.ReplaceAll(template, "{schema}", quotedSchema)
}
