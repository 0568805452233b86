package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/spf13/cobra"

	"github.com/txbox/txbox/migrations"
)

func (a *app) migrateCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate up|down|status",
		Short: "apply, roll back or show txbox's schema migrations",
		Args:  usageArgs(cobra.NoArgs),
		RunE:  needsSubcommand,
	}
	cmd.AddCommand(
		a.migrateUp(),
		a.migrateDown(),
		a.migrateStatus(),
	)
	return cmd
}

// withMigrationDB runs fn with a database/sql handle on --database-url, the kind goose needs.
func withMigrationDB(ctx context.Context, d *database, fn func(*sql.DB, *pgxpool.Pool) error) error {
	pool, err := d.open(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	return fn(db, pool)
}

func (a *app) migrateUp() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "up",
		Short: "create the schema if needed and apply every pending migration",
		Long: "Creates the schema if it does not exist and applies every pending migration. Several\n" +
			"processes may run it at once: they take turns on an advisory lock.",
		Args: usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		a.logStart(cmd)
		return withMigrationDB(cmd.Context(), d, func(db *sql.DB, _ *pgxpool.Pool) error {
			results, err := migrations.Up(cmd.Context(), db, migrations.WithSchema(d.schema))
			var partial *goose.PartialError
			if errors.As(err, &partial) {
				results = partial.Applied
			}
			for _, r := range results {
				fmt.Fprintf(a.stdout, "applied %s (%s)\n", r.Source.Path, r.Duration.Round(time.Millisecond))
			}
			if err != nil {
				return err
			}
			if len(results) == 0 {
				fmt.Fprintf(a.stdout, "schema %s is up to date\n", d.schema)
			}
			return nil
		})
	}
	return cmd
}

func (a *app) migrateDown() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "down",
		Short: "roll back every migration, dropping txbox's tables",
		Long: "Rolls back every migration: txbox's tables and their rows are dropped. It refuses while\n" +
			"the outbox holds rows not yet published or the DLQ holds letters, unless --force.",
		Args: usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	force := cmd.Flags().Bool("force", false, "drop the tables even though pending outbox rows or dead letters would be lost")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		a.logStart(cmd)
		return withMigrationDB(cmd.Context(), d, func(db *sql.DB, pool *pgxpool.Pool) error {
			opts := []migrations.Option{migrations.WithSchema(d.schema)}
			if *force {
				opts = append(opts, migrations.WithForce())
			}
			results, err := migrations.Down(cmd.Context(), db, opts...)
			var (
				notEmpty *migrations.NotEmptyError
				partial  *goose.PartialError
			)
			switch {
			case errors.Is(err, migrations.ErrSchemaNotFound):
				return usagef("%s: schema %q does not exist in database %q", refOf(cmd, "schema"), d.schema, pool.Config().ConnConfig.Database)
			case errors.Is(err, migrations.ErrNotInstalled):
				return usagef("%s: txbox is not installed in schema %q; nothing to roll back", refOf(cmd, "schema"), d.schema)
			case errors.As(err, &notEmpty):
				return fmt.Errorf("refusing to roll back schema %s: it holds %d outbox row(s) not yet published and %d dead letter(s), "+
					"which dropping the tables would lose; let the relay publish them and redrive or discard the letters, or pass --force",
					d.schema, notEmpty.OutboxRows, notEmpty.DeadLetters)
			case errors.As(err, &partial):
				results = partial.Applied
			}
			for _, r := range results {
				fmt.Fprintf(a.stdout, "rolled back %s\n", r.Source.Path)
			}
			return err
		})
	}
	return cmd
}

func (a *app) migrateStatus() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status",
		Short: "list migrations and whether each is applied",
		Args:  usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		return withMigrationDB(cmd.Context(), d, func(_ *sql.DB, pool *pgxpool.Pool) error {
			statuses, err := d.migrationStatus(cmd.Context(), pool)
			if err != nil {
				return err
			}
			applied, width := 0, 0
			for _, s := range statuses {
				width = max(width, len(s.Source.Path))
			}
			for _, s := range statuses {
				state := "pending"
				if s.State == goose.StateApplied {
					state = "applied " + s.AppliedAt.Format("2006-01-02 15:04:05")
					applied++
				}
				fmt.Fprintf(a.stdout, "%-*s %s\n", width, s.Source.Path, state)
			}
			if applied == 0 {
				fmt.Fprintf(a.stdout, "txbox is not installed in schema %s: run txbox migrate up\n", d.schema)
			}
			return nil
		})
	}
	return cmd
}
