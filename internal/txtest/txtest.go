// Package txtest sets up txbox for a test: a fresh schema with txbox's migrations applied, in the
// test PostgreSQL server, and a pool whose search_path is empty so that any SQL that forgets to
// qualify a table name fails loudly.
package txtest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the database/sql driver goose migrates through

	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/migrations"
)

// Env is one test's txbox installation.
type Env struct {
	// URL is the connection string of the test database (admin rights).
	URL string
	// Schema holds txbox's tables; tests create their business tables in it too.
	Schema string
	// Pool connects with an empty search_path.
	Pool *pgxpool.Pool
}

// Q qualifies a table name with the test's schema: env.Q("orders") is `"txbox_t_x".orders`.
func (e *Env) Q(table string) string {
	return pgx.Identifier{e.Schema, table}.Sanitize()
}

// New creates a migrated schema for the test, dropped when the test ends.
func New(t testing.TB) *Env {
	t.Helper()
	return NewIn(t, pgtest.AdminURL(t))
}

// NewIn is New in the database at url.
func NewIn(t testing.TB, url string) *Env {
	t.Helper()
	ctx := context.Background()
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	schema := "txbox_t_" + hex.EncodeToString(b)

	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatalf("txtest: %v", err)
	}
	defer db.Close()
	if _, err := migrations.Up(ctx, db, migrations.WithSchema(schema)); err != nil {
		t.Fatalf("txtest: migrate %s: %v", schema, err)
	}

	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("txtest: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("txtest: pool: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		conn, err := pgx.Connect(context.Background(), url)
		if err != nil {
			t.Logf("txtest: drop %s: %v", schema, err)
			return
		}
		defer conn.Close(context.Background())
		if _, err := conn.Exec(context.Background(), fmt.Sprintf("DROP SCHEMA %s CASCADE", pgx.Identifier{schema}.Sanitize())); err != nil {
			t.Logf("txtest: drop %s: %v", schema, err)
		}
	})
	return &Env{URL: url, Schema: schema, Pool: pool}
}

// RunRouter runs router until the test ends, when it is closed and must have stopped cleanly. It
// returns once the router runs its handlers.
func RunRouter(t testing.TB, router *message.Router) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("router: %v", err)
		}
	})
	<-router.Running()
}
