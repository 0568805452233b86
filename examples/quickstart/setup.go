package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/txbox/txbox/migrations"
)

// schema holds txbox's tables and the example's own; every txbox Config names it.
const schema = "txbox_quickstart"

// setUp connects to PostgreSQL, recreates the schema, installs txbox's tables in it and creates
// the service's. The pool's search_path is the schema, so the service's SQL needs no schema name.
func setUp(ctx context.Context, dsn string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("TXBOX_DATABASE_URL: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("cannot reach PostgreSQL at %s:%d: %w\n"+
			"Start PostgreSQL there, or set TXBOX_DATABASE_URL to a database where you may create a schema.",
			cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
	}
	_, err = pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+schema+` CASCADE; CREATE SCHEMA `+schema+`;
		CREATE TABLE orders (id text PRIMARY KEY, total bigint NOT NULL);
		CREATE TABLE invoices (order_id text NOT NULL, amount bigint NOT NULL)`)
	if err == nil {
		db := stdlib.OpenDBFromPool(pool)
		_, err = migrations.Up(ctx, db, migrations.WithSchema(schema))
		db.Close()
	}
	if err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// runInBackground runs fn in a goroutine; the returned function stops it and waits for it.
func runInBackground(ctx context.Context, logs *slog.Logger, fn func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := fn(ctx); err != nil {
			logs.Error("stopped", "error", err)
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// receive waits for the next value on c until ctx ends.
func receive[T any](ctx context.Context, c <-chan T) error {
	select {
	case <-c:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
