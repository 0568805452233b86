package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/retention"
)

func (a *app) statusCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status",
		Short: "show the dead-letter depth and the size of txbox's tables",
		Args:  usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		pool, err := d.connect(ctx, a.log)
		if err != nil {
			return err
		}
		defer pool.Close()
		depths, err := dlq.Stats(ctx, pool, d.schema)
		if err != nil {
			return err
		}
		fmt.Fprintln(a.stdout, "dead letters:")
		for _, src := range []dlq.Source{dlq.SourceInbox, dlq.SourceRelay} {
			n := depths[src]
			fmt.Fprintf(a.stdout, "  %-6s %d", src, n.Count)
			if n.Count > 0 {
				fmt.Fprintf(a.stdout, ", oldest %s", formatAge(time.Duration(n.OldestAgeSeconds*float64(time.Second))))
			}
			fmt.Fprintln(a.stdout)
		}
		sizes, err := retention.TableSizes(ctx, pool, d.schema)
		if err != nil {
			return err
		}
		fmt.Fprintln(a.stdout)
		return printTableSizes(a.stdout, sizes)
	}
	return cmd
}
