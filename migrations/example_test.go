package migrations_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"strings"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver goose runs on
	"github.com/pressly/goose/v3"

	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/migrations"
)

// Install txbox in a schema of its own, then check that nothing is pending. Running Up again (or
// from several processes at once) is safe.
func ExampleUp() {
	ctx := context.Background()
	url, err := pgtest.URL() // your application's connection string
	if err != nil {
		fmt.Println(err)
		return
	}
	schema := "txbox_example_" + strings.ToLower(rand.Text()[:8]) // yours: "txbox", say (unique here: the test database is shared)

	db, err := sql.Open("pgx", url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()
	defer db.ExecContext(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE") //nolint:errcheck // Best-effort cleanup.

	if _, err := migrations.Up(ctx, db, migrations.WithSchema(schema)); err != nil {
		fmt.Println(err)
		return
	}
	status, err := migrations.Status(ctx, db, migrations.WithSchema(schema))
	if err != nil {
		fmt.Println(err)
		return
	}
	pending := 0
	for _, s := range status {
		if s.State != goose.StateApplied {
			pending++
		}
	}
	fmt.Println("pending migrations:", pending)
	// Output:
	// pending migrations: 0
}
