package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/spf13/cobra"

	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/migrations"
)

// database holds --database-url and --schema, which every command that talks to PostgreSQL has.
type database struct {
	dsn, schema string
	cmd         *cobra.Command
}

func (a *app) databaseFlags(cmd *cobra.Command) *database {
	d := &database{schema: sqlname.DefaultSchema, cmd: cmd}
	f := a.setting(cmd.Flags(), dsnValue(&d.dsn), "database-url", "TXBOX_DATABASE_URL",
		"PostgreSQL connection string; the password may come from PGPASSWORD")
	annotate(f, annSecret, "true")
	annotate(f, annRequired, "true")
	f = a.setting(cmd.Flags(), text(&d.schema, schemaName), "schema", "TXBOX_SCHEMA", "schema holding txbox's tables")
	annotate(f, annField, "Config.Schema")
	return d
}

// defaultConnectTimeout bounds each new connection when the URL sets no connect_timeout, or 0 (which
// pgx cannot tell from none, and libpq takes for "wait for ever"): a server that takes the
// connection and never answers (hung, or something else listening on its port) held a command at
// its start for ever, where a supervisor must see it fail and restart it.
const defaultConnectTimeout = 10 * time.Second

// open opens a pool on --database-url and checks that PostgreSQL answers. Its sessions are named
// after the command ("txbox relay") in pg_stat_activity, unless the URL names them.
func (d *database) open(ctx context.Context) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(d.dsn)
	if err != nil {
		// dsnValue parsed it already; never print pgx's error, which quotes the string.
		return nil, usagef("%s is not a usable PostgreSQL connection string: %s (the value is not shown: it may hold a password)",
			refOf(d.cmd, "database-url"), dsnProblem(err))
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = d.cmd.CommandPath()
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = defaultConnectTimeout
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	// pgx connects lazily: without this, the first statement's error would name whatever ran it.
	// pgx's message names the user, host and database, never the password.
	if err := ping(ctx, pool, cfg.ConnConfig.ConnectTimeout); err != nil {
		pool.Close()
		return nil, fmt.Errorf("%s: cannot reach PostgreSQL: %w", refOf(d.cmd, "database-url"), err)
	}
	return pool, nil
}

// ping connects and makes one round trip. pgx bounds the connect by connect_timeout for each
// address it tries (the URL may list several hosts, one of them the healthy primary), so only the
// round trip gets a deadline of its own: a server that connects, then hangs, must not hold the
// command either.
func ping(ctx context.Context, pool *pgxpool.Pool, timeout time.Duration) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return conn.Ping(ctx)
}

// connect opens a pool and checks that txbox is installed in the schema, so that a mistyped
// schema is a usage error before anything runs rather than "relation does not exist" later.
func (d *database) connect(ctx context.Context) (*pgxpool.Pool, error) {
	pool, err := d.open(ctx)
	if err != nil {
		return nil, err
	}
	status, err := d.migrationStatus(ctx, pool)
	if err != nil {
		pool.Close()
		return nil, err
	}
	var pending []int64
	for _, s := range status {
		if s.State != goose.StateApplied {
			pending = append(pending, s.Source.Version)
		}
	}
	switch {
	case len(pending) == len(status):
		pool.Close()
		return nil, usagef("%s: txbox is not installed in schema %q; run: txbox migrate up --schema %s", refOf(d.cmd, "schema"), d.schema, d.schema)
	case len(pending) > 0:
		// This binary's statements need every column and index its migrations make: without them
		// it would fail later, in the middle of work, on a missing column.
		pool.Close()
		return nil, usagef("%s: schema %q lacks migrations %v that this txbox needs; run: txbox migrate up --schema %s",
			refOf(d.cmd, "schema"), d.schema, pending, d.schema)
	}
	return pool, nil
}

// migrationStatus is migrations.Status on pool, with a missing schema reported against --schema.
func (d *database) migrationStatus(ctx context.Context, pool *pgxpool.Pool) ([]*goose.MigrationStatus, error) {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	status, err := migrations.Status(ctx, db, migrations.WithSchema(d.schema))
	if errors.Is(err, migrations.ErrSchemaNotFound) {
		return nil, usagef("%s: schema %q does not exist in database %q", refOf(d.cmd, "schema"), d.schema, pool.Config().ConnConfig.Database)
	}
	return status, err
}

// connectAdmin makes an admin API for d's schema, then opens a pool. The admins qualify every
// table with the schema, so the connection's search_path does not matter; an error of newAdmin is
// a usage error naming the flag.
func connectAdmin[T any](ctx context.Context, a *app, d *database, newAdmin func(schema string) (T, error)) (*pgxpool.Pool, T, error) {
	admin, err := newAdmin(d.schema)
	if err != nil {
		return nil, admin, usagef("%v", fieldNames(d.cmd, err))
	}
	pool, err := d.connect(ctx)
	if err != nil {
		return nil, admin, err
	}
	return pool, admin, nil
}

// closeWithin closes pool, giving up after d with a warning.
func (a *app) closeWithin(pool *pgxpool.Pool, d time.Duration) {
	closed := make(chan struct{})
	go func() {
		pool.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(d):
		a.log.Warn("gave up closing the database connections", "after", d)
	}
}
