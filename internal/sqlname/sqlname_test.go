package sqlname_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/sqlname"
)

func TestSchema(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]string{"": `"public"`, "txbox": `"txbox"`, "_t1": `"_t1"`, "pgx": `"pgx"`} {
		got, err := sqlname.Schema(name)
		require.NoError(t, err, name)
		require.Equal(t, want, got, name)
	}
	for _, name := range []string{"Txbox", "1x", `x"; DROP TABLE y; --`, "a-b", string(make([]byte, 64))} {
		_, err := sqlname.Schema(name)
		require.ErrorContains(t, err, "not a valid name", name)
	}
	for _, name := range []string{"select", "user", "order", "system_user"} {
		_, err := sqlname.Schema(name)
		require.ErrorContains(t, err, "reserves", name)
	}
	for _, name := range []string{"pg_catalog", "information_schema", "pg_toast", "pg_temp_3", "pg_anything"} {
		_, err := sqlname.Schema(name)
		require.ErrorContains(t, err, "system schemas", name)
	}
}

// Importing the outbox or the inbox registers no database/sql driver: only migrations, which goose
// needs database/sql for, and the txbox command import pgx's stdlib adapter. (database/sql itself
// is imported by pgx for its Scanner and Valuer interfaces, and registers nothing.)
func TestOutboxAndInboxRegisterNoSQLDriver(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "github.com/txbox/txbox/outbox", "github.com/txbox/txbox/inbox").CombinedOutput()
	require.NoError(t, err, "%s", out)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, "github.com/txbox/txbox/internal/sqlname", "the listing is of the real import graph")
	for _, driver := range []string{"github.com/jackc/pgx/v5/stdlib", "github.com/lib/pq", "github.com/pressly/goose/v3"} {
		require.NotContains(t, deps, driver)
	}
}
