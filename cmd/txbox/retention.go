package main

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/txbox/txbox/retention"
)

func (a *app) retentionCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "retention --broker-retention AGE [flags]",
		Short: "delete inbox rows, attempt counters and call results txbox no longer needs",
		Long: "Starts a new inbox generation every --inbox-generation and drops old generations whole once\n" +
			"their newest row is past --inbox-retention (moving the rows that must stay); an older\n" +
			"generation's rows go only with it. Deletes, in small batches, the current generation's\n" +
			"processed inbox rows past --inbox-retention and dead ones whose letter was discarded, orphaned\n" +
			"attempt counters and old call results, then prints the tables' sizes. Runs once, or with\n" +
			"--every until SIGINT or SIGTERM. Processed inbox rows are also kept for --inbox-retention\n" +
			"before the oldest inbox letter in the DLQ, so a redrive stays a duplicate for the consumers\n" +
			"that processed the message.",
		Args: usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	var (
		broker, every time.Duration
		inbox         = retention.DefaultInboxRetention
		callResults   = retention.DefaultCallResultRetention
		batch         = retention.DefaultBatchSize
		generation    = retention.DefaultInboxGeneration
	)
	fs := cmd.Flags()
	f := a.setting(fs, durationIn(&broker, time.Minute, maxAge), "broker-retention", "TXBOX_BROKER_RETENTION",
		"how long the broker may redeliver a message: for Kafka, the topics' retention.ms plus segment.ms, e.g. 14d")
	annotate(f, annRequired, "true")
	annotate(f, annField, "Config.BrokerRetention")
	f = a.setting(fs, durationIn(&inbox, time.Hour, maxAge), "inbox-retention", "TXBOX_INBOX_RETENTION", "how long processed messages are remembered; must be longer than --broker-retention")
	annotate(f, annField, "Config.InboxRetention")
	f = a.setting(fs, durationIn(&callResults, retention.MinCallResultRetention, maxAge), "call-result-retention", "TXBOX_CALL_RESULT_RETENTION", "how long side-effect call results are kept (at least 1d: Stripe's idempotency key lifetime)")
	annotate(f, annField, "Config.CallResultRetention")
	f = a.setting(fs, durationIn(&generation, time.Hour, maxAge), "inbox-generation", "TXBOX_INBOX_GENERATION",
		"how long the inbox inserts into one generation before a pass starts a new one; a generation is dropped whole once its newest row is past --inbox-retention")
	annotate(f, annField, "Config.InboxGeneration")
	f = a.setting(fs, intIn(&batch, 1, 100000), "batch-size", "TXBOX_RETENTION_BATCH_SIZE", "most rows one DELETE removes")
	annotate(f, annField, "Config.BatchSize")
	f = a.setting(fs, durationIn(&every, time.Minute, 30*24*time.Hour), "every", "TXBOX_RETENTION_EVERY", "run a pass at this interval until stopped (default: one pass)")
	annotate(f, annField, "Config.Interval")

	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		if inbox <= broker {
			return usagef("%s (%s) must be longer than %s (%s): a message the broker redelivers after the inbox forgot it is processed twice",
				refOf(cmd, "inbox-retention"), formatDuration(inbox), refOf(cmd, "broker-retention"), formatDuration(broker))
		}
		pool, err := d.connect(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		c, err := retention.New(retention.Config{
			DB: pool, Schema: d.schema, BrokerRetention: broker, InboxRetention: inbox,
			CallResultRetention: callResults, InboxGeneration: generation, BatchSize: batch, Interval: every, Logger: a.log,
		})
		if err != nil {
			return usagef("%v", fieldNames(cmd, err))
		}
		a.logStart(cmd)
		if every > 0 {
			return c.Run(ctx)
		}
		rep, err := c.RunOnce(ctx)
		if err != nil {
			return err
		}
		fmt.Fprintf(a.stdout, "inbox generation %d; dropped %d old generation(s) whole, moving %d row(s) that must stay\n",
			rep.Generation, len(rep.GenerationsDropped), rep.GenerationRowsMoved)
		if rep.RotationDeferred {
			fmt.Fprintln(a.stdout, "a new generation was due but deliveries in flight held it back; the next pass starts it")
		}
		fmt.Fprintf(a.stdout, "deleted one by one %d processed and %d dead inbox row(s) of the current generation, %d attempt counter(s), %d call result(s) in %s\n",
			rep.DoneDeleted, rep.DeadDeleted, rep.AttemptsDeleted, rep.CallResultsDeleted, rep.Duration.Round(time.Millisecond))
		if rep.OldestLetterAge > 0 {
			fmt.Fprintf(a.stdout, "processed inbox rows received since %s are kept: the oldest inbox letter in the DLQ is %s old\n",
				rep.DoneCutoff.Format(time.RFC3339), formatAge(rep.OldestLetterAge))
		}
		fmt.Fprintln(a.stdout)
		return printTableSizes(a.stdout, rep.Tables)
	}
	return cmd
}

func printTableSizes(w io.Writer, sizes []retention.TableSize) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TABLE\tSIZE\tLIVE ROWS (est.)\tDEAD ROWS (est.)") // PostgreSQL's statistics, not counts
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
