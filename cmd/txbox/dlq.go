package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/sqlname"
)

// maxUnpacedRedrive is the most letters a redrive moves without an explicit --rate: a redrive is
// new traffic for every consumer of the topics and for the APIs they call.
const maxUnpacedRedrive = 100

const dlqUsage = `Usage: txbox dlq <subcommand> [flags]

Inspect, redrive and discard dead letters.

Subcommands:
  list      list letters (--json for machine-readable output)
  show ID   show one letter in full, payload included
  redrive   write letters back into the outbox, paced by --rate, and delete them from the DLQ
  discard   delete letters (needs a filter or --all)

Filters (list, redrive, discard; they combine with AND):
  --source inbox|relay  --kind message|call  --topic T  --consumer C  --reason TEXT
  --older-than AGE  --younger-than AGE  --id N[,N…] (repeatable)  --limit N

Run 'txbox dlq <subcommand> --help' for its flags.
`

func runDLQ(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, dlqUsage)
		return fmt.Errorf("%w: dlq needs a subcommand: list, show, redrive or discard", errUsage)
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(os.Stderr, dlqUsage)
		return nil
	case "list":
		return runDLQList(ctx, args[1:], stdout)
	case "show":
		return runDLQShow(ctx, args[1:], stdout)
	case "redrive":
		return runDLQRedrive(ctx, args[1:], stdout)
	case "discard":
		return runDLQDiscard(ctx, args[1:], stdout)
	}
	fmt.Fprint(os.Stderr, dlqUsage)
	return fmt.Errorf("%w: unknown dlq subcommand %q (want list, show, redrive or discard)", errUsage, args[0])
}

// dlqCommand holds the settings every dlq subcommand shares.
type dlqCommand struct {
	*flags
	name        string
	dsn, schema string

	source, kind, topic, consumer, reason string
	olderThan, youngerThan                ageValue
	ids                                   idsValue
	limit                                 intValue
	all                                   bool
}

func newDLQCommand(name, usageLine string) *dlqCommand {
	c := &dlqCommand{flags: newFlags("dlq "+name, usageLine), name: name}
	c.database(&c.dsn, &c.schema)
	return c
}

// filterFlags defines the filter flags; withAll adds --all for the commands that change letters.
func (c *dlqCommand) filterFlags(defaultLimit int, withAll bool) {
	c.StringVar(&c.source, "source", "", "only letters from this component: inbox or relay")
	c.StringVar(&c.kind, "kind", "", "only letters of this kind: message or call")
	c.StringVar(&c.topic, "topic", "", "only letters of this topic")
	c.StringVar(&c.consumer, "consumer", "", "only letters of this consumer")
	c.StringVar(&c.reason, "reason", "", "only letters whose reason contains this text, ignoring case")
	c.Var(&c.olderThan, "older-than", "only letters that first failed at least this long ago, e.g. 90m, 36h, 7d")
	c.Var(&c.youngerThan, "younger-than", "only letters that first failed less than this long ago")
	c.Var(&c.ids, "id", "only these letters; repeat the flag or separate ids with commas")
	c.limit = intValue(defaultLimit)
	c.Var(&c.limit, "limit", "at most this many letters, lowest ids first; 0 means no limit")
	if withAll {
		c.BoolVar(&c.all, "all", false, "select every letter when no other filter is given")
	}
}

// parse parses args, allowing flags after positional arguments (`show 42 --json`), and checks
// the settings every subcommand needs.
func (c *dlqCommand) parse(args []string) ([]string, error) {
	var positional []string
	for {
		if err := c.flags.parse(args); err != nil {
			return nil, err
		}
		if c.NArg() == 0 {
			break
		}
		rest := c.Args()
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			positional = append(positional, rest...)
			break
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
	if err := c.required("database-url", c.dsn); err != nil {
		return nil, err
	}
	if _, err := sqlname.Schema(c.schema); err != nil {
		return nil, fmt.Errorf("%w: --schema: %w", errUsage, err)
	}
	if c.source != "" && c.source != string(dlq.SourceInbox) && c.source != string(dlq.SourceRelay) {
		return nil, fmt.Errorf("%w: --source must be inbox or relay, got %q", errUsage, c.source)
	}
	if c.kind != "" && c.kind != "message" && c.kind != "call" {
		return nil, fmt.Errorf("%w: --kind must be message or call, got %q", errUsage, c.kind)
	}
	if c.limit < 0 {
		return nil, fmt.Errorf("%w: --limit must not be negative, got %d", errUsage, c.limit)
	}
	return positional, nil
}

func (c *dlqCommand) noArgs(positional []string) error {
	if len(positional) > 0 {
		return fmt.Errorf("%w: dlq %s takes no arguments, got %q", errUsage, c.name, positional)
	}
	return nil
}

func (c *dlqCommand) filter() dlq.Filter {
	return dlq.Filter{
		Source: dlq.Source(c.source), Kind: c.kind, Topic: c.topic, Consumer: c.consumer, Reason: c.reason,
		OlderThan: time.Duration(c.olderThan), YoungerThan: time.Duration(c.youngerThan),
		IDs: c.ids, Limit: int(c.limit), All: c.all,
	}
}

// requireFilter refuses to change every letter by accident.
func (c *dlqCommand) requireFilter(f dlq.Filter) error {
	if f.IsEmpty() && !f.All {
		return fmt.Errorf("%w: dlq %s needs a filter (--source, --kind, --topic, --consumer, --reason, --older-than, --younger-than, --id) or --all", errUsage, c.name)
	}
	return nil
}

// connect opens a pool and the admin API. The admin qualifies every table with the schema, so
// the connection's search_path does not matter.
func (c *dlqCommand) connect(ctx context.Context) (*pgxpool.Pool, *dlq.Admin, error) {
	admin, err := dlq.NewAdmin(dlq.AdminConfig{Schema: c.schema})
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	pool, err := pgxpool.New(ctx, c.dsn)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: --database-url: %w", errUsage, err)
	}
	return pool, admin, nil
}

func runDLQList(ctx context.Context, args []string, stdout io.Writer) error {
	c := newDLQCommand("list", "dlq list [filters] [--json]")
	c.filterFlags(100, false)
	asJSON := c.Bool("json", false, "print a JSON array (payloads left out; see show)")
	positional, err := c.parse(args)
	if err != nil {
		return err
	}
	if err := c.noArgs(positional); err != nil {
		return err
	}
	pool, admin, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()

	f := c.filter()
	letters, err := admin.List(ctx, pool, f)
	if err != nil {
		return err
	}
	if *asJSON {
		out := make([]letterJSON, len(letters))
		for i, l := range letters {
			out[i] = toJSON(l, false)
		}
		return writeJSON(stdout, out)
	}
	total := len(letters)
	if f.Limit > 0 && total == f.Limit {
		f.Limit = 0
		if total, err = admin.Count(ctx, pool, f); err != nil {
			return err
		}
	}
	now := time.Now()
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSOURCE\tKIND\tTOPIC\tCONSUMER\tREASON\tATTEMPTS\tAGE\tUUID")
	for _, l := range letters {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", l.ID, l.Source, l.Kind, l.Topic, dash(l.Consumer),
			l.Reason, l.Attempts, formatAge(now.Sub(l.FirstFailedAt)), l.UUID)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if total > len(letters) {
		fmt.Fprintf(stdout, "%d of %d letters (raise --limit to see more)\n", len(letters), total)
	} else {
		fmt.Fprintf(stdout, "%d letter(s)\n", total)
	}
	return nil
}

func runDLQShow(ctx context.Context, args []string, stdout io.Writer) error {
	c := newDLQCommand("show", "dlq show ID [--json]")
	asJSON := c.Bool("json", false, "print a JSON object; the payload is in \"payload\" when it is UTF-8 text, else in \"payload_base64\"")
	positional, err := c.parse(args)
	if err != nil {
		return err
	}
	if len(positional) != 1 {
		return fmt.Errorf("%w: dlq show needs exactly one letter id (see dlq list)", errUsage)
	}
	id, err := strconv.ParseInt(positional[0], 10, 64)
	if err != nil || id <= 0 {
		return fmt.Errorf("%w: dlq show: %q is not a letter id", errUsage, positional[0])
	}
	pool, admin, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()

	l, err := admin.Get(ctx, pool, id)
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(stdout, toJSON(l, true))
	}
	now := time.Now()
	tw := tabwriter.NewWriter(stdout, 0, 4, 1, ' ', 0)
	row := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, v) }
	row("id", strconv.FormatInt(l.ID, 10))
	row("source", string(l.Source))
	row("kind", l.Kind)
	row("topic", l.Topic)
	row("consumer", dash(l.Consumer))
	row("dedup key", dash(l.DedupKey))
	row("partition key", dash(l.PartitionKey))
	row("uuid", l.UUID)
	if l.IdempotencyKey != "" {
		row("idempotency key", l.IdempotencyKey)
	}
	row("reason", l.Reason)
	row("attempts", strconv.Itoa(l.Attempts))
	row("first failed", fmt.Sprintf("%s (%s ago)", l.FirstFailedAt.Format(time.RFC3339), formatAge(now.Sub(l.FirstFailedAt))))
	row("last failed", fmt.Sprintf("%s (%s ago)", l.LastFailedAt.Format(time.RFC3339), formatAge(now.Sub(l.LastFailedAt))))
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "error:\n%s\n", indent(dash(l.Error)))
	fmt.Fprintln(stdout, "metadata:")
	keys := make([]string, 0, len(l.Metadata))
	for k := range l.Metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		fmt.Fprintf(stdout, "  %s: %s\n", k, l.Metadata[k])
	}
	if utf8.Valid(l.Payload) {
		fmt.Fprintf(stdout, "payload (%d bytes):\n%s\n", len(l.Payload), indent(string(l.Payload)))
	} else {
		fmt.Fprintf(stdout, "payload (%d bytes, base64):\n%s\n", len(l.Payload), indent(base64.StdEncoding.EncodeToString(l.Payload)))
	}
	if l.Kind == "call" {
		fmt.Fprintln(stdout, "\nThis is a side-effect call: it cannot be redriven. Reconcile it with the provider by hand, then discard it.")
	}
	return nil
}

func runDLQRedrive(ctx context.Context, args []string, stdout io.Writer) error {
	c := newDLQCommand("redrive", "dlq redrive [filters] (--rate N | more than 100 letters not selected) [--dry-run]\n\n"+
		"Writes the selected letters back into the outbox, with their UUIDs, payloads, metadata and partition\n"+
		"keys, so the relay publishes them again to their topics, and deletes them from the DLQ. Each batch is\n"+
		"one transaction: interrupting is safe, and running the same command again continues. Side-effect\n"+
		"calls (--kind call) cannot be redriven: reconcile them with the provider, then discard them.")
	c.filterFlags(0, true)
	var (
		pace         rateValue
		burst, batch intValue
		dryRun       bool
	)
	c.Var(&pace, "rate", fmt.Sprintf("letters moved per second; required when more than %d letters are selected", maxUnpacedRedrive))
	c.Var(&burst, "burst", "letters that may move at once before --rate applies, and the largest batch (default: a tenth of a second's worth, at most --batch-size)")
	batch = dlq.DefaultRedriveBatchSize
	c.Var(&batch, "batch-size", "letters moved per transaction")
	c.BoolVar(&dryRun, "dry-run", false, "show what would be redriven and move nothing")
	positional, err := c.parse(args)
	if err != nil {
		return err
	}
	if err := c.noArgs(positional); err != nil {
		return err
	}
	if burst < 0 || batch <= 0 {
		return fmt.Errorf("%w: --batch-size must be positive and --burst must not be negative", errUsage)
	}
	f := c.filter()
	if err := c.requireFilter(f); err != nil {
		return err
	}
	pool, admin, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()

	plan, err := admin.Redrive(ctx, pool, f, dlq.RedriveOptions{Rate: rate.Inf, DryRun: true})
	if err != nil {
		return err
	}
	if plan.Planned == 0 {
		fmt.Fprintln(stdout, "no letters match; nothing to redrive")
		return nil
	}
	if dryRun {
		return printRedrivePlan(ctx, stdout, pool, admin, f, plan, pace)
	}
	opts := dlq.RedriveOptions{Rate: rate.Limit(pace.v), Burst: int(burst), BatchSize: int(batch)}
	if !pace.set {
		if plan.Planned > maxUnpacedRedrive {
			return fmt.Errorf("%w: %d letters match; redriving more than %d needs an explicit --rate (letters per second), "+
				"because every consumer of %s and the APIs they call see them as new traffic; try --dry-run first",
				errUsage, plan.Planned, maxUnpacedRedrive, topicNames(plan.Topics))
		}
		// Unpaced, but only what was counted: letters that arrive meanwhile wait for a paced run.
		opts.Rate = rate.Inf
		if f.Limit == 0 || f.Limit > plan.Planned {
			f.Limit = plan.Planned
		}
	}

	var lastReport time.Time
	opts.Progress = func(p dlq.RedriveProgress) {
		if time.Since(lastReport) < time.Second && p.Moved < p.Total {
			return
		}
		lastReport = time.Now()
		slog.Info("redrive progress", "moved", p.Moved, "total", p.Total, "rate", fmt.Sprintf("%.1f/s", perSecond(p.Moved, p.Elapsed)))
	}
	res, err := admin.Redrive(ctx, pool, f, opts)
	if err != nil {
		if res.Moved > 0 || ctx.Err() != nil {
			fmt.Fprintf(stdout, "moved %d of %d letter(s) before stopping; run the same command again to continue\n", res.Moved, res.Planned)
		}
		return err
	}
	fmt.Fprintf(stdout, "redrove %d letter(s) into the outbox in %s (%.1f/s); released %d dead inbox row(s)\n",
		res.Moved, res.Elapsed.Round(time.Millisecond), perSecond(res.Moved, res.Elapsed), res.Released)
	return nil
}

func printRedrivePlan(ctx context.Context, stdout io.Writer, pool *pgxpool.Pool, admin *dlq.Admin, f dlq.Filter, plan dlq.RedriveResult, pace rateValue) error {
	fmt.Fprintf(stdout, "dry run: %d letter(s) would be redriven:\n", plan.Planned)
	for _, t := range plan.Topics {
		fmt.Fprintf(stdout, "  %-30s %d\n", t.Topic, t.Letters)
	}
	const sample = 20
	if f.Limit == 0 || f.Limit > sample {
		f.Limit = sample
	}
	letters, err := admin.List(ctx, pool, f)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout)
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSOURCE\tTOPIC\tCONSUMER\tREASON\tUUID")
	for _, l := range letters {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\n", l.ID, l.Source, l.Topic, dash(l.Consumer), l.Reason, l.UUID)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if plan.Planned > len(letters) {
		fmt.Fprintf(stdout, "… and %d more\n", plan.Planned-len(letters))
	}
	switch {
	case pace.set:
		fmt.Fprintf(stdout, "at %g letters/s this takes about %s\n", pace.v,
			time.Duration(float64(plan.Planned)/pace.v*float64(time.Second)).Round(time.Second))
	case plan.Planned > maxUnpacedRedrive:
		fmt.Fprintf(stdout, "a real run needs --rate: more than %d letters are selected\n", maxUnpacedRedrive)
	}
	fmt.Fprintln(stdout, "nothing was moved")
	return nil
}

func runDLQDiscard(ctx context.Context, args []string, stdout io.Writer) error {
	c := newDLQCommand("discard", "dlq discard [filters | --all] [--dry-run]\n\n"+
		"Deletes the selected letters for good. The consumers' inbox rows stay, so the broker's\n"+
		"redeliveries of those messages are still skipped.")
	c.filterFlags(0, true)
	dryRun := c.Bool("dry-run", false, "count what would be discarded and delete nothing")
	positional, err := c.parse(args)
	if err != nil {
		return err
	}
	if err := c.noArgs(positional); err != nil {
		return err
	}
	f := c.filter()
	if err := c.requireFilter(f); err != nil {
		return err
	}
	pool, admin, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()

	if *dryRun {
		n, err := admin.Count(ctx, pool, f)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "dry run: %d letter(s) would be discarded; nothing was deleted\n", n)
		return nil
	}
	n, err := admin.Discard(ctx, pool, f)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "discarded %d letter(s)", n)
	if len(f.IDs) > n {
		fmt.Fprintf(stdout, " (%d of the given ids did not match)", len(f.IDs)-n)
	}
	fmt.Fprintln(stdout)
	return nil
}

// letterJSON is the --json form of a letter; field names are part of the CLI's interface.
type letterJSON struct {
	ID             int64             `json:"id"`
	Source         string            `json:"source"`
	Kind           string            `json:"kind"`
	Topic          string            `json:"topic"`
	Consumer       string            `json:"consumer"`
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
	PayloadBytes   int               `json:"payload_bytes"`
	Payload        *string           `json:"payload,omitempty"`
	PayloadBase64  *string           `json:"payload_base64,omitempty"`
}

func toJSON(l dlq.Letter, withPayload bool) letterJSON {
	j := letterJSON{
		ID: l.ID, Source: string(l.Source), Kind: l.Kind, Topic: l.Topic, Consumer: l.Consumer, DedupKey: l.DedupKey,
		PartitionKey: l.PartitionKey, UUID: l.UUID, IdempotencyKey: l.IdempotencyKey, Reason: l.Reason, Error: l.Error,
		Attempts: l.Attempts, FirstFailedAt: l.FirstFailedAt, LastFailedAt: l.LastFailedAt, Metadata: l.Metadata,
		PayloadBytes: len(l.Payload),
	}
	if withPayload {
		if utf8.Valid(l.Payload) {
			s := string(l.Payload)
			j.Payload = &s
		} else {
			s := base64.StdEncoding.EncodeToString(l.Payload)
			j.PayloadBase64 = &s
		}
	}
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
func formatAge(d time.Duration) string {
	d = max(d, 0).Round(time.Second)
	switch {
	case d < time.Minute:
		return d.String()
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh%dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%dh", int(d.Hours())/24, int(d.Hours())%24)
}

// ageValue is a duration flag that also accepts whole days: 7d, 1d12h.
type ageValue time.Duration

func (v *ageValue) String() string { return time.Duration(*v).String() }
func (v *ageValue) Set(s string) error {
	d, err := parseAge(s)
	if err != nil {
		return err
	}
	*v = ageValue(d)
	return nil
}

func parseAge(s string) (time.Duration, error) {
	var days time.Duration
	if i := strings.IndexByte(s, 'd'); i > 0 {
		n, err := strconv.Atoi(s[:i])
		if err != nil {
			return 0, errors.New("not a duration such as 90m, 36h, 7d or 1d12h")
		}
		days, s = time.Duration(n)*24*time.Hour, s[i+1:]
		if s == "" {
			s = "0s"
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, errors.New("not a duration such as 90m, 36h, 7d or 1d12h")
	}
	if d+days < 0 {
		return 0, errors.New("must not be negative")
	}
	return d + days, nil
}

// idsValue collects letter ids from repeated flags and comma-separated lists.
type idsValue []int64

func (v *idsValue) String() string {
	s := make([]string, len(*v))
	for i, id := range *v {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ",")
}

func (v *idsValue) Set(s string) error {
	for part := range strings.SplitSeq(s, ",") {
		id, err := strconv.ParseInt(strings.TrimSpace(part), 10, 64)
		if err != nil || id <= 0 {
			return fmt.Errorf("%q is not a letter id", part)
		}
		*v = append(*v, id)
	}
	return nil
}

// rateValue is a positive rate that remembers whether it was given.
type rateValue struct {
	v   float64
	set bool
}

func (v *rateValue) String() string {
	if !v.set {
		return ""
	}
	return strconv.FormatFloat(v.v, 'g', -1, 64)
}

func (v *rateValue) Set(s string) error {
	r, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(r) || r <= 0 {
		return errors.New("not a positive number of letters per second")
	}
	v.v, v.set = r, true
	return nil
}

var _ flag.Value = (*rateValue)(nil)
