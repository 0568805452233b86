package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txbox/txbox/retention"
)

func runRetention(ctx context.Context, args []string, stdout io.Writer) error {
	f := newFlags("retention", "retention --broker-retention AGE [flags]\n\n"+
		"Deletes processed inbox rows, dead inbox rows whose letter was discarded, orphaned attempt\n"+
		"counters and old call results, in small batches, then prints the tables' sizes. Runs once,\n"+
		"or with --every until SIGINT or SIGTERM. Processed inbox rows are also kept for\n"+
		"--inbox-retention before the oldest inbox letter in the DLQ, so a redrive stays a duplicate\n"+
		"for the consumers that processed the message.")
	var (
		dsn, schema                       string
		broker, inbox, callResults, every ageValue
		batch                             = intValue(retention.DefaultBatchSize)
	)
	inbox = ageValue(retention.DefaultInboxRetention)
	callResults = ageValue(retention.DefaultCallResultRetention)
	f.database(&dsn, &schema)
	f.varEnv(&broker, "broker-retention", "TXBOX_BROKER_RETENTION",
		"how long the broker may redeliver a message: for Kafka, the topics' retention.ms plus segment.ms, e.g. 14d (required)")
	f.varEnv(&inbox, "inbox-retention", "TXBOX_INBOX_RETENTION", "how long processed messages are remembered; must be longer than --broker-retention")
	f.varEnv(&callResults, "call-result-retention", "TXBOX_CALL_RESULT_RETENTION", "how long side-effect call results are kept")
	f.varEnv(&batch, "batch-size", "TXBOX_RETENTION_BATCH_SIZE", "most rows one DELETE removes")
	f.varEnv(&every, "every", "TXBOX_RETENTION_EVERY", "run a pass at this interval until stopped; 0 runs once")
	if err := f.parse(args); err != nil {
		return err
	}
	if f.NArg() > 0 {
		return fmt.Errorf("%w: retention takes no arguments, got %q", errUsage, f.Args())
	}
	if err := f.required("database-url", dsn); err != nil {
		return err
	}
	if broker <= 0 {
		return fmt.Errorf("%w: --broker-retention is required (or set TXBOX_BROKER_RETENTION): how long the broker may redeliver a message "+
			"(for Kafka, the topics' retention.ms plus segment.ms)", errUsage)
	}
	if inbox <= broker {
		return fmt.Errorf("%w: --inbox-retention (%s) must be longer than --broker-retention (%s): "+
			"a message the broker redelivers after the inbox forgot it is processed twice", errUsage, formatAge(time.Duration(inbox)), formatAge(time.Duration(broker)))
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return fmt.Errorf("%w: --database-url: %w", errUsage, err)
	}
	defer pool.Close()
	c, err := retention.New(retention.Config{
		DB: pool, Schema: schema,
		BrokerRetention: time.Duration(broker), InboxRetention: time.Duration(inbox),
		CallResultRetention: time.Duration(callResults), BatchSize: int(batch), Interval: time.Duration(every),
	})
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if every > 0 {
		return c.Run(ctx)
	}
	rep, err := c.RunOnce(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "deleted %d processed and %d dead inbox row(s), %d attempt counter(s), %d call result(s) in %s\n",
		rep.DoneDeleted, rep.DeadDeleted, rep.AttemptsDeleted, rep.CallResultsDeleted, rep.Duration.Round(time.Millisecond))
	if rep.OldestLetterAge > 0 {
		fmt.Fprintf(stdout, "processed inbox rows received since %s are kept: the oldest inbox letter in the DLQ is %s old\n",
			rep.DoneCutoff.Format(time.RFC3339), formatAge(rep.OldestLetterAge))
	}
	fmt.Fprintln(stdout)
	return printTableSizes(stdout, rep.Tables)
}

func printTableSizes(w io.Writer, sizes []retention.TableSize) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TABLE\tSIZE\tLIVE ROWS\tDEAD ROWS")
	for _, s := range sizes {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\n", s.Table, formatBytes(s.TotalBytes), s.LiveRows, s.DeadRows)
	}
	return tw.Flush()
}

func formatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
