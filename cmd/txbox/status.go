package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/retention"
)

func runStatus(ctx context.Context, args []string, stdout io.Writer) error {
	f := newFlags("status", "status [flags]\n\nShows the dead-letter depth per source and the size of txbox's tables.")
	var dsn, schema string
	f.database(&dsn, &schema)
	if err := f.parse(args); err != nil {
		return err
	}
	if f.NArg() > 0 {
		return fmt.Errorf("%w: status takes no arguments, got %q", errUsage, f.Args())
	}
	if err := f.required("database-url", dsn); err != nil {
		return err
	}
	if _, err := sqlname.Schema(schema); err != nil {
		return fmt.Errorf("%w: --schema: %w", errUsage, err)
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return fmt.Errorf("%w: --database-url: %w", errUsage, err)
	}
	defer pool.Close()

	depths, err := dlq.Stats(ctx, pool, schema)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, "dead letters:")
	for _, src := range []dlq.Source{dlq.SourceInbox, dlq.SourceRelay} {
		d := depths[src]
		fmt.Fprintf(stdout, "  %-6s %d", src, d.Count)
		if d.Count > 0 {
			fmt.Fprintf(stdout, ", oldest %s", formatAge(time.Duration(d.OldestAgeSeconds*float64(time.Second))))
		}
		fmt.Fprintln(stdout)
	}
	sizes, err := retention.TableSizes(ctx, pool, schema)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout)
	return printTableSizes(stdout, sizes)
}
