package main

import (
	"context"
	"fmt"
	"io"

	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/migrations"
)

func runMigrate(ctx context.Context, args []string, stdout io.Writer) error {
	f := newFlags("migrate", "migrate up|down|status [flags]\n\n  up      apply every pending migration\n  down    roll back every migration (drops txbox's tables and their rows)\n  status  list migrations and whether each is applied")
	var dsn, schema string
	f.database(&dsn, &schema)
	if err := f.parse(args); err != nil {
		return err
	}
	if f.NArg() != 1 {
		f.Usage()
		return fmt.Errorf("%w: migrate needs exactly one of up, down, status", errUsage)
	}
	action := f.Arg(0)
	if action != "up" && action != "down" && action != "status" {
		return fmt.Errorf("%w: unknown migrate action %q (want up, down or status)", errUsage, action)
	}
	if err := f.required("database-url", dsn); err != nil {
		return err
	}
	if _, err := sqlname.Schema(schema); err != nil {
		return fmt.Errorf("%w: --schema: %w", errUsage, err)
	}
	db, err := sqlname.OpenDB(ctx, dsn, schema)
	if err != nil {
		return err
	}
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		return err
	}
	switch action {
	case "up":
		results, err := p.Up(ctx)
		for _, r := range results {
			fmt.Fprintf(stdout, "applied %s (%s)\n", r.Source.Path, r.Duration.Round(1e6))
		}
		if err != nil {
			return fmt.Errorf("migrate up: %w", err)
		}
		if len(results) == 0 {
			fmt.Fprintln(stdout, "schema is up to date")
		}
	case "down":
		results, err := p.DownTo(ctx, 0)
		for _, r := range results {
			fmt.Fprintf(stdout, "rolled back %s\n", r.Source.Path)
		}
		if err != nil {
			return fmt.Errorf("migrate down: %w", err)
		}
	case "status":
		statuses, err := p.Status(ctx)
		if err != nil {
			return fmt.Errorf("migrate status: %w", err)
		}
		for _, s := range statuses {
			state := "pending"
			if s.State == "applied" {
				state = "applied " + s.AppliedAt.Format("2006-01-02 15:04:05")
			}
			fmt.Fprintf(stdout, "%-30s %s\n", s.Source.Path, state)
		}
	}
	return nil
}
