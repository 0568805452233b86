package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/txbox/txbox/relay"
)

func (a *app) outboxCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "outbox list|show|bury",
		Short: "inspect pending outbox rows and move a stuck one to the DLQ by hand",
		Long: "Inspect what the relay has still to publish or execute, shard by shard, and move a row that\n" +
			"cannot go anywhere (a retired topic, say) to the dead-letter table.\n\n" +
			"Stored text is printed with control characters escaped (\\x1b, \\u202e); --json is exact.",
		Args: usageArgs(cobra.NoArgs),
		RunE: needsSubcommand,
	}
	cmd.AddCommand(a.outboxList(), a.outboxShow(), a.outboxBury())
	return cmd
}

// outboxConnect opens a pool and the relay's admin API for the lease table's layout.
func (a *app) outboxConnect(ctx context.Context, d *database) (*pgxpool.Pool, *relay.Admin, error) {
	return connectAdmin(ctx, a, d, func(schema string) (*relay.Admin, error) {
		return relay.NewAdmin(relay.AdminConfig{Schema: schema})
	})
}

func (a *app) outboxList() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "list [filters] [--json]",
		Short: "pending rows per shard (owner, oldest age), then the rows themselves, oldest first",
		Args:  usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	var f relay.Filter
	f.Limit = 100
	// Filters have no environment variables, like the dlq's: a variable left in a shell must
	// never select rows to bury.
	fs := cmd.Flags()
	fs.IntSliceVar(&f.Shards, "shard", nil, "only rows of these shards; repeat the flag or separate shards with commas")
	fs.Var(text(&f.Kind, oneOf("message", "call")), "kind", "only rows of this kind: message or call")
	fs.StringVar(&f.Topic, "topic", "", "only rows of this topic (calls: reply topic)")
	fs.StringVar(&f.PartitionKey, "key", "", "only rows of this partition key")
	fs.BoolVar(&f.Failing, "failing", false, "only rows whose last attempt failed (refused by the broker, or calls being retried)")
	fs.Var(durationIn(&f.OlderThan, 0, maxAge), "older-than", "only rows pending at least this long, e.g. 90m, 36h, 7d")
	fs.Int64Var(&f.AfterID, "after-id", 0, "only rows with a higher id: the last id of a page gives the next")
	fs.Var(intIn(&f.Limit, 1, 10000), "limit", "at most this many rows, lowest ids first")
	asJSON := fs.Bool("json", false, `print {"shards": [...], "rows": [...]}, exact (payloads left out; see show)`)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		pool, admin, err := a.outboxConnect(ctx, d)
		if err != nil {
			return err
		}
		defer pool.Close()
		backlog, err := admin.Backlog(ctx, pool)
		if err != nil {
			return err
		}
		for _, shard := range f.Shards {
			if shard < 0 || shard >= len(backlog) {
				return usagef("--shard %d: the relays' layout has %d shards, 0 to %d", shard, len(backlog), len(backlog)-1)
			}
		}
		rows, err := admin.List(ctx, pool, f)
		if err != nil {
			return usagef("%v", err)
		}
		if *asJSON {
			out := struct {
				Shards []shardJSON `json:"shards"`
				Rows   []rowJSON   `json:"rows"`
			}{Shards: make([]shardJSON, len(backlog)), Rows: make([]rowJSON, len(rows))}
			for i, b := range backlog {
				out.Shards[i] = shardJSON{b.Shard, b.Owner, b.Messages, b.Calls, b.Failing, b.OldestAge.Seconds()}
			}
			for i, r := range rows {
				out.Rows[i] = toRowJSON(r, false)
			}
			return writeJSON(a.stdout, out)
		}
		return printBacklog(a.stdout, backlog, rows, f.Limit)
	}
	return cmd
}

// printBacklog writes the shards that have pending rows or no owner, then the rows.
func printBacklog(w io.Writer, backlog []relay.ShardBacklog, rows []relay.Row, limit int) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SHARD\tOWNER\tMESSAGES\tCALLS\tFAILING\tOLDEST")
	var pending int64
	busy := 0
	for _, b := range backlog {
		pending += b.Messages + b.Calls
		if b.Messages+b.Calls > 0 {
			busy++
		}
		if b.Messages+b.Calls == 0 && b.Owner != "" {
			continue
		}
		oldest := "-"
		if b.Messages+b.Calls > 0 {
			oldest = formatAge(b.OldestAge)
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%s\n", b.Shard, dash(cell(b.Owner)), b.Messages, b.Calls, b.Failing, oldest)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "%d pending row(s) in %d of %d shard(s); shards without pending rows and with an owner are not shown\n\n", pending, busy, len(backlog))
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSHARD\tKIND\tTOPIC\tKEY\tATTEMPTS\tAGE\tLAST ERROR")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\t%d\t%s\t%s\n", r.ID, r.Shard, r.Kind, dash(column(r.Topic)), dash(column(r.PartitionKey)),
			r.Attempts, formatAge(r.Age), dash(cell(truncate(r.LastError, 80))))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(rows) == limit {
		fmt.Fprintf(w, "%d row(s) shown; --after-id %d shows the next page\n", len(rows), rows[len(rows)-1].ID)
	} else {
		fmt.Fprintf(w, "%d row(s)\n", len(rows))
	}
	return nil
}

func (a *app) outboxShow() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "show ID [--json]",
		Short: "show one pending row in full, payload and last error included",
		Args:  usageArgs(cobra.ExactArgs(1)),
	}
	d := a.databaseFlags(cmd)
	asJSON := cmd.Flags().Bool("json", false, "print a JSON object, exact; the payload is in \"payload\" when it is UTF-8 text, else in \"payload_base64\"")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		id, err := rowID(cmd, args[0])
		if err != nil {
			return err
		}
		pool, admin, err := a.outboxConnect(ctx, d)
		if err != nil {
			return err
		}
		defer pool.Close()
		r, err := admin.Get(ctx, pool, id)
		if err != nil {
			return explainNotPending(err)
		}
		if *asJSON {
			return writeJSON(a.stdout, toRowJSON(r, true))
		}
		return printRow(a.stdout, r)
	}
	return cmd
}

func (a *app) outboxBury() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bury ID --reason TEXT",
		Short: "move one pending row to the dead-letter table, with the reason a person gave up on it",
		Long: "Moves one pending row to the dead-letter table (reason \"" + relay.ReasonBuried + "\", your --reason as its\n" +
			"error). It waits for a relay completing the same row at that moment, so a row is never both\n" +
			"published and buried by the database's account; a send already under way may still reach Kafka\n" +
			"(consumers drop the copy a later redrive makes) or the provider: the relay then stores and replies\n" +
			"the provider's answer when it comes, and logs it (reconcile a buried call with it).",
		Args: usageArgs(cobra.ExactArgs(1)),
	}
	d := a.databaseFlags(cmd)
	var reason string
	cmd.Flags().Var(text(&reason, nonEmpty), "reason", "why the row is given up on, for whoever reads the letter (required)")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		id, err := rowID(cmd, args[0])
		if err != nil {
			return err
		}
		if reason == "" {
			return usagef("%s needs --reason: say why the row is given up on", cmd.CommandPath())
		}
		pool, admin, err := a.outboxConnect(ctx, d)
		if err != nil {
			return err
		}
		defer pool.Close()
		r, err := admin.Bury(ctx, pool, id, reason)
		if err != nil {
			return explainNotPending(err)
		}
		a.log.Info("outbox row buried", "id", r.ID, "shard", r.Shard, "kind", r.Kind, "topic", r.Topic, "uuid", r.UUID, "reason", reason)
		fmt.Fprintf(a.stdout, "buried outbox row %d (%s for %s, uuid %s): it is in the dead-letter table now (txbox dlq list --source relay)\n",
			r.ID, r.Kind, dash(cell(r.Topic)), cell(r.UUID))
		if r.Kind == "call" && r.Attempts > 0 {
			// Its last attempt may be at the provider now: nothing records a send under way.
			fmt.Fprintf(a.stdout, "the call was attempted %d time(s): if a request is at the provider now, the relay stores and replies its answer when it comes, and logs it\n", r.Attempts)
		}
		return nil
	}
	return cmd
}

// explainNotPending says where a row that is not pending may have gone.
func explainNotPending(err error) error {
	if errors.Is(err, relay.ErrRowNotFound) {
		return fmt.Errorf("%w: it was published, executed or buried since it was listed, or never written (txbox dlq list, txbox status)", err)
	}
	return err
}

func rowID(cmd *cobra.Command, arg string) (int64, error) {
	id, err := strconv.ParseInt(arg, 10, 64)
	if err != nil || id <= 0 {
		return 0, usagef("%s: %q is not an outbox row id (see txbox outbox list)", cmd.CommandPath(), arg)
	}
	return id, nil
}

// printRow writes a pending row for a person: every stored string sanitised.
func printRow(w io.Writer, r relay.Row) error {
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	field := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, v) }
	field("id", strconv.FormatInt(r.ID, 10))
	field("kind", r.Kind)
	field("shard", strconv.Itoa(r.Shard))
	field("topic", dash(cell(r.Topic)))
	field("partition key", dash(cell(r.PartitionKey)))
	field("uuid", cell(r.UUID))
	if r.IdempotencyKey != "" {
		field("idempotency key", cell(r.IdempotencyKey))
	}
	field("attempts", strconv.Itoa(r.Attempts))
	field("created", fmt.Sprintf("%s (%s ago)", r.CreatedAt.Format(time.RFC3339), formatAge(r.Age)))
	if !r.NextAttemptAt.IsZero() {
		field("next attempt", r.NextAttemptAt.Format(time.RFC3339))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	printMessage(w, "last error", r.LastError, r.Metadata, r.Payload)
	return nil
}

// shardJSON and rowJSON are the --json forms; field names are part of the CLI's interface.
type shardJSON struct {
	Shard            int     `json:"shard"`
	Owner            string  `json:"owner"`
	Messages         int64   `json:"messages"`
	Calls            int64   `json:"calls"`
	Failing          int64   `json:"failing"`
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
}

type rowJSON struct {
	ID             int64             `json:"id"`
	Kind           string            `json:"kind"`
	Shard          int               `json:"shard"`
	Topic          string            `json:"topic"`
	PartitionKey   string            `json:"partition_key"`
	UUID           string            `json:"uuid"`
	IdempotencyKey string            `json:"idempotency_key,omitempty"`
	Attempts       int               `json:"attempts"`
	LastError      string            `json:"last_error"`
	CreatedAt      time.Time         `json:"created_at"`
	NextAttemptAt  *time.Time        `json:"next_attempt_at,omitempty"`
	AgeSeconds     float64           `json:"age_seconds"`
	Metadata       map[string]string `json:"metadata"`
	payloadJSON
}

func toRowJSON(r relay.Row, withPayload bool) rowJSON {
	j := rowJSON{
		ID: r.ID, Kind: r.Kind, Shard: r.Shard, Topic: r.Topic, PartitionKey: r.PartitionKey, UUID: r.UUID,
		IdempotencyKey: r.IdempotencyKey, Attempts: r.Attempts, LastError: r.LastError, CreatedAt: r.CreatedAt,
		AgeSeconds: r.Age.Seconds(), Metadata: r.Metadata, payloadJSON: newPayloadJSON(r.Payload, r.PayloadBytes, withPayload),
	}
	if !r.NextAttemptAt.IsZero() {
		j.NextAttemptAt = &r.NextAttemptAt
	}
	return j
}

// truncate shortens s to at most n runes for a table cell.
func truncate(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}
