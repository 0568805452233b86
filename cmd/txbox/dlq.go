package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/age"
)

// maxUnpacedRedrive is the most letters a redrive moves without an explicit --rate.
const maxUnpacedRedrive = dlq.MaxUnpacedRedrive

func (a *app) dlqCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dlq list|show|redrive|discard",
		Short: "list, show, redrive (paced) or discard dead letters",
		Long: "Inspect, redrive and discard dead letters.\n\n" +
			"Filters (list, redrive, discard; they combine with AND):\n" +
			"  --source inbox|relay  --kind message|call  --topic T  --consumer C  --handler H  --reason TEXT\n" +
			"  --older-than AGE  --younger-than AGE  --id N[,N...] (repeatable)  --limit N\n\n" +
			"Stored text is printed with control characters escaped (\\x1b, \\u202e); --json is exact.",
		Args: usageArgs(cobra.NoArgs),
		RunE: needsSubcommand,
	}
	cmd.AddCommand(a.dlqList(), a.dlqShow(), a.dlqRedrive(), a.dlqDiscard())
	return cmd
}

// dlqFilter holds the filter flags of list, redrive and discard.
type dlqFilter struct {
	source, kind, topic, consumer, handler, reason string
	olderThan, youngerThan                         time.Duration
	ids                                            []int64
	limit                                          int
	all                                            bool
}

// filterFlags defines the filter flags; withAll adds --all for the commands that change letters.
// They have no environment variables: a variable left in a shell must never select letters.
func filterFlags(cmd *cobra.Command, defaultLimit int, withAll bool) *dlqFilter {
	f := &dlqFilter{limit: defaultLimit}
	fs := cmd.Flags()
	fs.Var(text(&f.source, oneOf(string(dlq.SourceInbox), string(dlq.SourceRelay))), "source", "only letters from this component: inbox or relay")
	fs.Var(text(&f.kind, oneOf("message", "call")), "kind", "only letters of this kind: message or call")
	fs.StringVar(&f.topic, "topic", "", "only letters of this topic")
	fs.StringVar(&f.consumer, "consumer", "", "only letters of this consumer")
	fs.StringVar(&f.handler, "handler", "", "only letters of this router handler (inbox letters)")
	fs.StringVar(&f.reason, "reason", "", "only letters whose reason contains this text, ignoring case")
	fs.Var(durationIn(&f.olderThan, 0, maxAge), "older-than", "only letters that first failed at least this long ago, e.g. 90m, 36h, 7d")
	fs.Var(durationIn(&f.youngerThan, 0, maxAge), "younger-than", "only letters that first failed less than this long ago")
	fs.Var(idsValue(&f.ids), "id", "only these letters; repeat the flag or separate ids with commas")
	fs.Var(intIn(&f.limit, 0, 1_000_000), "limit", "at most this many letters, lowest ids first; 0 means no limit")
	if withAll {
		fs.BoolVar(&f.all, "all", false, "select every letter when no other filter is given")
	}
	return f
}

func (f *dlqFilter) filter() dlq.Filter {
	return dlq.Filter{
		Source: dlq.Source(f.source), Kind: f.kind, Topic: f.topic, Consumer: f.consumer, Handler: f.handler, Reason: f.reason,
		OlderThan: f.olderThan, YoungerThan: f.youngerThan, IDs: f.ids, Limit: f.limit, All: f.all,
	}
}

// requireFilter refuses to change every letter by accident.
func requireFilter(cmd *cobra.Command, f dlq.Filter) error {
	if f.IsEmpty() && !f.All {
		return usagef("%s needs a filter (--source, --kind, --topic, --consumer, --handler, --reason, --older-than, --younger-than, --id) or --all", cmd.CommandPath())
	}
	return nil
}

// dlqConnect opens a pool and the dead letters' admin API.
func (a *app) dlqConnect(ctx context.Context, d *database) (*pgxpool.Pool, *dlq.Admin, error) {
	return connectAdmin(ctx, a, d, func(schema string) (*dlq.Admin, error) {
		return dlq.NewAdmin(dlq.AdminConfig{Schema: schema})
	})
}

func (a *app) dlqList() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "list [filters] [--json]",
		Short: "list letters (--json for machine-readable output)",
		Args:  usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	filter := filterFlags(cmd, 100, false)
	asJSON := cmd.Flags().Bool("json", false, "print a JSON array, exact (payloads left out; see show)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		pool, admin, err := a.dlqConnect(ctx, d)
		if err != nil {
			return err
		}
		defer pool.Close()
		f := filter.filter()
		letters, err := admin.List(ctx, pool, f)
		if err != nil {
			return err
		}
		if *asJSON {
			out := make([]letterJSON, len(letters))
			for i, l := range letters {
				out[i] = toJSON(l, false)
			}
			return writeJSON(a.stdout, out)
		}
		total := len(letters)
		if f.Limit > 0 && total == f.Limit {
			f.Limit = 0
			if total, err = admin.Count(ctx, pool, f); err != nil {
				return err
			}
		}
		now := time.Now()
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tSOURCE\tKIND\tTOPIC\tCONSUMER\tHANDLER\tREASON\tATTEMPTS\tAGE\tUUID")
		for _, l := range letters {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", l.ID, l.Source, cell(l.Kind), column(l.Topic), dash(column(l.Consumer)),
				dash(column(l.Handler)), column(l.Reason), l.Attempts, formatAge(now.Sub(l.FirstFailedAt)), column(l.UUID))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if total > len(letters) {
			fmt.Fprintf(a.stdout, "%d of %d letters (raise --limit to see more)\n", len(letters), total)
		} else {
			fmt.Fprintf(a.stdout, "%d letter(s)\n", total)
		}
		return nil
	}
	return cmd
}

func (a *app) dlqShow() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "show ID [--json]",
		Short: "show one letter in full, payload included",
		Args:  usageArgs(cobra.ExactArgs(1)),
	}
	d := a.databaseFlags(cmd)
	asJSON := cmd.Flags().Bool("json", false, "print a JSON object, exact; the payload is in \"payload\" when it is UTF-8 text, else in \"payload_base64\"")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		id, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil || id <= 0 {
			return usagef("%s: %q is not a letter id (see txbox dlq list)", cmd.CommandPath(), args[0])
		}
		pool, admin, err := a.dlqConnect(ctx, d)
		if err != nil {
			return err
		}
		defer pool.Close()
		l, err := admin.Get(ctx, pool, id)
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(a.stdout, toJSON(l, true))
		}
		return printLetter(a.stdout, l, time.Now())
	}
	return cmd
}

// printLetter writes a letter for a person: every stored string sanitised.
func printLetter(w io.Writer, l dlq.Letter, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, v) }
	row("id", strconv.FormatInt(l.ID, 10))
	row("source", cell(string(l.Source)))
	row("kind", cell(l.Kind))
	row("topic", cell(l.Topic))
	row("consumer", dash(cell(l.Consumer)))
	row("handler", dash(cell(l.Handler)))
	row("dedup key", dash(cell(l.DedupKey)))
	row("partition key", dash(cell(l.PartitionKey)))
	row("uuid", cell(l.UUID))
	if l.IdempotencyKey != "" {
		row("idempotency key", cell(l.IdempotencyKey))
	}
	row("reason", cell(l.Reason))
	row("attempts", strconv.Itoa(l.Attempts))
	row("first failed", fmt.Sprintf("%s (%s ago)", l.FirstFailedAt.Format(time.RFC3339), formatAge(now.Sub(l.FirstFailedAt))))
	row("last failed", fmt.Sprintf("%s (%s ago)", l.LastFailedAt.Format(time.RFC3339), formatAge(now.Sub(l.LastFailedAt))))
	if err := tw.Flush(); err != nil {
		return err
	}
	printMessage(w, "error", l.Error, l.Metadata, l.Payload)
	if l.Kind == "call" {
		fmt.Fprintln(w, "\nThis is a side-effect call: it cannot be redriven. Reconcile it with the provider by hand, then discard it.")
	}
	return nil
}

// printMessage writes the stored error, metadata and payload of a letter or an outbox row for a
// person, sanitised; a payload that is not UTF-8 is shown in base64.
func printMessage(w io.Writer, errorLabel, errorText string, metadata map[string]string, payload []byte) {
	fmt.Fprintf(w, "%s:\n%s\n", errorLabel, indent(dash(sanitize(errorText, true))))
	fmt.Fprintln(w, "metadata:")
	keys := make([]string, 0, len(metadata))
	for k := range metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "  %s: %s\n", cell(k), cell(metadata[k]))
	}
	if utf8.Valid(payload) {
		fmt.Fprintf(w, "payload (%d bytes):\n%s\n", len(payload), indent(sanitize(string(payload), true)))
	} else {
		fmt.Fprintf(w, "payload (%d bytes, base64):\n%s\n", len(payload), indent(base64.StdEncoding.EncodeToString(payload)))
	}
}

func (a *app) dlqRedrive() *cobra.Command {
	cmd := &cobra.Command{
		Use:   fmt.Sprintf("redrive [filters] (--rate N | at most %d letters selected) [--dry-run]", maxUnpacedRedrive),
		Short: "write letters back into the outbox, paced by --rate, and delete them from the DLQ",
		Long: "Writes the selected letters back into the outbox, with their UUIDs, payloads, metadata and partition\n" +
			"keys, so the relay publishes them again to their topics, and deletes them from the DLQ. Each batch is\n" +
			"one transaction: interrupting is safe, and running the same command again continues. Side-effect\n" +
			"calls (--kind call) cannot be redriven: reconcile them with the provider, then discard them.",
		Args: usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	filter := filterFlags(cmd, 0, true)
	var (
		pace         float64
		burst, batch = 0, dlq.DefaultRedriveBatchSize
		dryRun       bool
	)
	fs := cmd.Flags()
	a.setting(fs, floatIn(&pace, 0.001, 100_000), "rate", "TXBOX_REDRIVE_RATE",
		fmt.Sprintf("letters moved per second; required when more than %d letters are selected", maxUnpacedRedrive))
	a.setting(fs, intIn(&burst, 1, 10_000), "burst", "TXBOX_REDRIVE_BURST",
		"letters that may move at once before --rate applies, at most --batch-size (default: a tenth of a second's worth)")
	a.setting(fs, intIn(&batch, 1, 10_000), "batch-size", "TXBOX_REDRIVE_BATCH_SIZE", "letters moved per transaction")
	fs.BoolVar(&dryRun, "dry-run", false, "show what would be redriven and move nothing")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		if burst > batch {
			return usagef("%s (%d) must not be larger than %s (%d)", refOf(cmd, "burst"), burst, refOf(cmd, "batch-size"), batch)
		}
		f := filter.filter()
		if err := requireFilter(cmd, f); err != nil {
			return err
		}
		pool, admin, err := a.dlqConnect(ctx, d)
		if err != nil {
			return err
		}
		defer pool.Close()

		plan, err := admin.Redrive(ctx, pool, f, dlq.RedriveOptions{Rate: rate.Inf, DryRun: true})
		switch { // The selection is the flags'.
		case errors.Is(err, dlq.ErrCallNotRedrivable):
			return usagef("%v (narrow the selection: --kind message)", err)
		case errors.Is(err, dlq.ErrNoMessageID), errors.Is(err, dlq.ErrNoTopic), errors.Is(err, dlq.ErrTooLarge):
			return usagef("%v (see one with txbox dlq show ID, discard them with txbox dlq discard --id, or narrow the selection)", err)
		}
		if err != nil {
			return err
		}
		if plan.Planned == 0 {
			fmt.Fprintln(a.stdout, "no letters match; nothing to redrive")
			return nil
		}
		if dryRun {
			return a.printRedrivePlan(ctx, pool, admin, f, plan, pace)
		}
		f, opts, err := dlq.PaceFor(f, plan, dlq.RedriveOptions{Rate: rate.Limit(pace), Burst: burst, BatchSize: batch})
		if err != nil {
			return usagef("%d letters match; redriving more than %d needs an explicit %s (letters per second), "+
				"because every consumer of %s and the APIs they call see them as new traffic; try --dry-run first",
				plan.Planned, maxUnpacedRedrive, refOf(cmd, "rate"), cell(topicNames(plan.Topics)))
		}
		resolved, err := opts.Resolved()
		if err != nil {
			return usagef("%v", err)
		}
		pacing := any(float64(resolved.Rate))
		if resolved.Rate == rate.Inf {
			pacing = "unlimited"
		}
		a.logStart(cmd, "letters", plan.Planned, "rate", pacing, "burst", resolved.Burst, "batch_size", resolved.BatchSize)
		var lastReport time.Time
		opts.Progress = func(p dlq.RedriveProgress) {
			if time.Since(lastReport) < time.Second && p.Moved < p.Total {
				return
			}
			lastReport = time.Now()
			a.log.Info("redrive progress", "moved", p.Moved, "total", p.Total, "rate", fmt.Sprintf("%.1f/s", perSecond(p.Moved, p.Elapsed)))
		}
		res, err := admin.Redrive(ctx, pool, f, opts)
		if err != nil {
			if res.Moved > 0 || ctx.Err() != nil {
				fmt.Fprintf(a.stdout, "moved %d of %d letter(s) before stopping; run the same command again to continue\n", res.Moved, res.Planned)
			}
			return err
		}
		fmt.Fprintf(a.stdout, "redrove %d letter(s) into the outbox in %s (%.1f/s); released %d dead inbox row(s)\n",
			res.Moved, res.Elapsed.Round(time.Millisecond), perSecond(res.Moved, res.Elapsed), res.Released)
		return nil
	}
	return cmd
}

func (a *app) printRedrivePlan(ctx context.Context, pool *pgxpool.Pool, admin *dlq.Admin, f dlq.Filter, plan dlq.RedriveResult, pace float64) error {
	fmt.Fprintf(a.stdout, "dry run: %d letter(s) would be redriven:\n", plan.Planned)
	for _, t := range plan.Topics {
		fmt.Fprintf(a.stdout, "  %-30s %d\n", cell(t.Topic), t.Letters)
	}
	const sample = 20
	if f.Limit == 0 || f.Limit > sample {
		f.Limit = sample
	}
	letters, err := admin.List(ctx, pool, f)
	if err != nil {
		return err
	}
	fmt.Fprintln(a.stdout)
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSOURCE\tTOPIC\tCONSUMER\tHANDLER\tREASON\tUUID")
	for _, l := range letters {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", l.ID, l.Source, column(l.Topic), dash(column(l.Consumer)), dash(column(l.Handler)),
			column(l.Reason), column(l.UUID))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if plan.Planned > len(letters) {
		fmt.Fprintf(a.stdout, "… and %d more\n", plan.Planned-len(letters))
	}
	switch {
	case pace > 0:
		fmt.Fprintf(a.stdout, "at %g letters/s this takes about %s\n", pace,
			time.Duration(float64(plan.Planned)/pace*float64(time.Second)).Round(time.Second))
	case plan.Planned > maxUnpacedRedrive:
		fmt.Fprintf(a.stdout, "a real run needs --rate: more than %d letters are selected\n", maxUnpacedRedrive)
	}
	fmt.Fprintln(a.stdout, "nothing was moved")
	return nil
}

func (a *app) dlqDiscard() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "discard [filters | --all] [--dry-run]",
		Short: "delete letters (needs a filter or --all)",
		Long: "Deletes the selected letters for good. The consumers' inbox rows stay, so the broker's\n" +
			"redeliveries of those messages are still skipped.",
		Args: usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	filter := filterFlags(cmd, 0, true)
	dryRun := cmd.Flags().Bool("dry-run", false, "count what would be discarded and delete nothing")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		f := filter.filter()
		if err := requireFilter(cmd, f); err != nil {
			return err
		}
		pool, admin, err := a.dlqConnect(ctx, d)
		if err != nil {
			return err
		}
		defer pool.Close()
		if *dryRun {
			n, err := admin.Count(ctx, pool, f)
			if err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "dry run: %d letter(s) would be discarded; nothing was deleted\n", n)
			return nil
		}
		n, err := admin.Discard(ctx, pool, f)
		if err != nil {
			return err
		}
		fmt.Fprintf(a.stdout, "discarded %d letter(s)", n)
		if len(f.IDs) > n {
			fmt.Fprintf(a.stdout, " (%d of the given ids did not match)", len(f.IDs)-n)
		}
		fmt.Fprintln(a.stdout)
		return nil
	}
	return cmd
}

// letterJSON is the --json form of a letter; field names are part of the CLI's interface.
type letterJSON struct {
	ID             int64             `json:"id"`
	Source         string            `json:"source"`
	Kind           string            `json:"kind"`
	Topic          string            `json:"topic"`
	Consumer       string            `json:"consumer"`
	Handler        string            `json:"handler"`
	DedupKey       string            `json:"dedup_key"`
	PartitionKey   string            `json:"partition_key"`
	UUID           string            `json:"uuid"`
	IdempotencyKey string            `json:"idempotency_key,omitempty"`
	Reason         string            `json:"reason"`
	Error          string            `json:"error"`
	Attempts       int               `json:"attempts"`
	FirstFailedAt  time.Time         `json:"first_failed_at"`
	LastFailedAt   time.Time         `json:"last_failed_at"`
	Metadata       map[string]string `json:"metadata"`
	payloadJSON
}

func toJSON(l dlq.Letter, withPayload bool) letterJSON {
	return letterJSON{
		ID: l.ID, Source: string(l.Source), Kind: l.Kind, Topic: l.Topic, Consumer: l.Consumer, Handler: l.Handler, DedupKey: l.DedupKey,
		PartitionKey: l.PartitionKey, UUID: l.UUID, IdempotencyKey: l.IdempotencyKey, Reason: l.Reason, Error: l.Error,
		Attempts: l.Attempts, FirstFailedAt: l.FirstFailedAt, LastFailedAt: l.LastFailedAt, Metadata: l.Metadata,
		payloadJSON: newPayloadJSON(l.Payload, len(l.Payload), withPayload),
	}
}

// payloadJSON is a payload in --json output: its size, and with the payload the payload itself in
// "payload" when it is UTF-8 text, else in "payload_base64".
type payloadJSON struct {
	PayloadBytes  int     `json:"payload_bytes"`
	Payload       *string `json:"payload,omitempty"`
	PayloadBase64 *string `json:"payload_base64,omitempty"`
}

func newPayloadJSON(payload []byte, size int, withPayload bool) payloadJSON {
	j := payloadJSON{PayloadBytes: size}
	if !withPayload {
		return j
	}
	s := string(payload)
	if !utf8.Valid(payload) {
		s = base64.StdEncoding.EncodeToString(payload)
		j.PayloadBase64 = &s
		return j
	}
	j.Payload = &s
	return j
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func topicNames(ts []dlq.TopicCount) string {
	var names []string
	for _, t := range ts {
		if !slices.Contains(names, t.Topic) {
			names = append(names, t.Topic)
		}
	}
	return strings.Join(names, ", ")
}

func perSecond(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func indent(s string) string {
	return "  " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n  ")
}

// formatAge prints an age compactly: 45s, 12m, 3h5m, 2d4h.
func formatAge(d time.Duration) string { return age.Format(d) }

// parseAge parses a Go duration or whole days and a Go duration: 7d, 1d12h.
func parseAge(s string) (time.Duration, error) { return age.Parse(s) }

// idsValue collects letter ids from repeated flags and comma-separated lists.
func idsValue(p *[]int64) *value[[]int64] {
	v := &value[[]int64]{p: p, typ: "ids", show: func(ids []int64) string {
		s := make([]string, len(ids))
		for i, id := range ids {
			s[i] = strconv.FormatInt(id, 10)
		}
		return strings.Join(s, ",")
	}}
	v.parse = func(s string) ([]int64, error) {
		ids := *p
		for part := range strings.SplitSeq(s, ",") {
			id, err := strconv.ParseInt(strings.TrimSpace(part), 10, 64)
			if err != nil || id <= 0 {
				return nil, fmt.Errorf("must be letter ids, got %q", part)
			}
			ids = append(ids, id)
		}
		return ids, nil
	}
	return v
}
