package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/txbox/txbox/status"
)

func (a *app) statusCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status [--json] [--window D]",
		Short: "show the outbox backlog, leases, relays, dead letters, dedup hit rate, call failures and table sizes",
		Long: "Reads every figure in one snapshot, by the database clock, and says how old each one is.\n" +
			"Stored text (owners, errors, names) is printed with control characters escaped; --json is exact.",
		Args: usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	window := status.DefaultWindow
	a.setting(cmd.Flags(), durationIn(&window, time.Minute, 30*24*time.Hour), "window", "TXBOX_STATUS_WINDOW",
		"how far back the dedup hit rate and the recent call results look")
	asJSON := cmd.Flags().Bool("json", false, "print the report as a JSON object, exact (the status package's Report)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		pool, err := d.connect(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		rep, err := status.Read(ctx, pool, status.Options{Schema: d.schema, Window: window})
		if err != nil {
			return err
		}
		if *asJSON {
			enc := json.NewEncoder(a.stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(rep)
		}
		return printStatus(a.stdout, rep)
	}
	return cmd
}

// printStatus writes rep as aligned sections. Every stored string goes through cell.
func printStatus(out io.Writer, rep *status.Report) error {
	at := rep.At
	ago := func(t time.Time) string { return formatAge(at.Sub(t)) + " ago" }
	until := func(t time.Time) string {
		if t.After(at) {
			return "in " + formatAge(t.Sub(at))
		}
		return ago(t)
	}
	due := func(t *time.Time) string {
		if t == nil || !t.After(at) {
			return "due"
		}
		return "in " + formatAge(t.Sub(at))
	}
	secs := func(s float64) string { return formatAge(time.Duration(s * float64(time.Second))) }
	window := secs(rep.WindowSeconds)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	// section starts a table, or says there is nothing to show.
	section := func(title, header string, rows int) {
		fmt.Fprintf(tw, "\n%s\n", title)
		if rows == 0 {
			fmt.Fprintln(tw, "none")
			return
		}
		fmt.Fprintln(tw, header)
	}

	fmt.Fprintf(tw, "schema %s at %s (database clock)\n", cell(rep.Schema), at.UTC().Format(time.RFC3339))

	outbox := "OUTBOX: nothing pending"
	if rep.Outbox.Pending > 0 {
		outbox = fmt.Sprintf("OUTBOX: %d pending, oldest %s", rep.Outbox.Pending, secs(rep.Outbox.OldestPendingSeconds))
	}
	section(outbox,
		"SHARD\tMESSAGES\tCALLS\tFAILING\tOLDEST\tPUBLISHED BY", len(rep.Outbox.Shards))
	for _, s := range rep.Outbox.Shards {
		oldest, owner := "-", cell(s.Owner)
		if s.Messages+s.Calls > 0 {
			oldest = secs(s.OldestPendingSeconds)
		}
		if owner == "" {
			owner = "nobody (no live lease)"
		}
		fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%s\t%s\n", s.Shard, s.Messages, s.Calls, s.Failing, oldest, owner)
	}

	section("LEASES", "SHARD\tOWNER\tTOKEN\tEXPIRES", len(rep.Leases))
	for _, l := range rep.Leases {
		var expires string
		switch {
		case l.ExpiresAt == nil:
			expires = "free (never held or released)"
		case l.Expired:
			expires = "expired " + ago(*l.ExpiresAt)
		default:
			expires = until(*l.ExpiresAt)
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\n", l.Shard, dash(cell(l.Owner)), l.Token, expires)
	}

	section("RELAYS", "OWNER\tSTATE\tREGISTRATION EXPIRES", len(rep.Relays))
	for _, n := range rep.Relays {
		state := "live"
		if !n.Live {
			state = "gone"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", cell(n.Owner), state, until(n.ExpiresAt))
	}

	section("DEAD LETTERS", "SOURCE\tCOUNT\tOLDEST", len(rep.DeadLetters))
	for _, d := range rep.DeadLetters {
		oldest := "-"
		if d.Count > 0 {
			oldest = secs(d.OldestAgeSeconds)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\n", d.Source, d.Count, oldest)
	}

	section("DEDUP (last "+window+")", "CONSUMER\tHANDLER\tCHECKS\tHITS\tHIT RATE\tUPDATED", len(rep.Dedup))
	for _, d := range rep.Dedup {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.1f%%\t%s\n", cell(d.Consumer), dash(cell(d.Handler)), d.Checks, d.Hits,
			100*d.HitRate, secs(d.AgeSeconds)+" ago")
	}

	section("CALLS FAILING (retried)", "ID\tIDEMPOTENCY KEY\tSHARD\tATTEMPTS\tFIRST ATTEMPT\tNEXT\tLAST ERROR", len(rep.Calls.Failing))
	for _, c := range rep.Calls.Failing {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%s\t%s\t%s\n", c.ID, cell(c.IdempotencyKey), c.Shard, c.Attempts,
			ago(c.FirstAttemptAt), due(c.NextAttemptAt), cell(c.LastError))
	}
	section("CALLS NOT SUCCEEDED (last "+window+")", "IDEMPOTENCY KEY\tOUTCOME\tHTTP\tOBJECT\tCOMPLETED", len(rep.Calls.Unsuccessful))
	for _, c := range rep.Calls.Unsuccessful {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", cell(c.IdempotencyKey), cell(c.Outcome), c.HTTPStatus, dash(cell(c.ObjectID)), ago(c.CompletedAt))
	}
	section("CALL DEAD LETTERS (last "+window+")", "ID\tIDEMPOTENCY KEY\tREASON\tATTEMPTS\tFIRST FAILED", len(rep.Calls.DeadLetters))
	for _, c := range rep.Calls.DeadLetters {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\n", c.ID, cell(c.IdempotencyKey), cell(c.Reason), c.Attempts, ago(c.FirstFailedAt))
	}

	section("TABLES", "TABLE\tSIZE\tLIVE ROWS (est.)\tDEAD ROWS (est.)", len(rep.Tables))
	for _, t := range rep.Tables {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\n", t.Table, formatBytes(t.TotalBytes), t.LiveRows, t.DeadRows)
	}

	section("FRESHNESS", "FIGURE\tAGE\tNOTE", len(rep.Freshness))
	for _, f := range rep.Freshness {
		age := "0s"
		if f.AgeSeconds > 0 {
			age = "up to " + secs(f.AgeSeconds)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", f.Figure, age, f.Note)
	}
	return tw.Flush()
}
