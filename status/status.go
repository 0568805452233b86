// Package status reads what an operator wants to know about one txbox installation (a schema) in
// one consistent snapshot: the outbox backlog per shard, the leases and the relays holding them,
// the dead letters, the dedup hit rate over a recent window, recent call failures and the sizes of
// txbox's tables. `txbox status` prints it; a console or a health endpoint can serve the same
// Report.
//
// Every figure is read through the package that owns its table (relay, dlq, inbox, retention), in
// one read-only repeatable-read transaction, so figures agree with each other and with Report.At,
// the database clock at that instant. Report.Freshness says which figures are older than that
// and by how much.
package status

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/retention"
)

// Defaults of Options.
const (
	DefaultWindow = 15 * time.Minute
	DefaultLimit  = 20
)

// Options select what Read reports. Zero values mean the documented defaults.
type Options struct {
	// Schema holds txbox's tables. If not specified, defaults to "public".
	Schema string
	// Window is how far back the dedup hit rate and the recent call results look. If not
	// specified, defaults to DefaultWindow (15 minutes).
	Window time.Duration
	// Limit bounds each list of calls and call letters. If not specified, defaults to
	// DefaultLimit (20).
	Limit int
}

// DB is what Read needs from PostgreSQL; *pgxpool.Pool satisfies it.
type DB interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// Report is the state of one txbox schema. Its JSON form (the field tags) is what `txbox status
// --json` prints; fields are only ever added to it.
type Report struct {
	// At is the database clock when the snapshot was taken.
	At            time.Time `json:"at"`
	Schema        string    `json:"schema"`
	WindowSeconds float64   `json:"window_seconds"`

	Outbox      Outbox        `json:"outbox"`
	Leases      []relay.Lease `json:"leases"`
	Relays      []relay.Node  `json:"relays"`
	DeadLetters []DeadLetters `json:"dead_letters"`
	// Dedup is the hit rate per consumer and handler over the window, for the inboxes that write
	// their counts (inbox.Config.StatsInterval).
	Dedup []Dedup `json:"dedup"`
	Calls Calls   `json:"calls"`
	// Tables are the sizes of txbox's tables; row counts are the statistics collector's estimates.
	Tables []Table `json:"tables"`
	// Freshness says how old each figure is at At.
	Freshness []Figure `json:"freshness"`
}

// Outbox is what waits in the outbox.
type Outbox struct {
	// Pending is the number of rows (messages and calls) not yet published or executed.
	Pending              int64   `json:"pending"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	// Shards lists every shard of the lease layout, by shard (relay.Admin.Backlog).
	Shards []Shard `json:"shards"`
}

// Shard is what waits in one shard, and who publishes it.
type Shard struct {
	Shard    int   `json:"shard"`
	Messages int64 `json:"messages"`
	Calls    int64 `json:"calls"`
	// Failing counts the rows whose last attempt failed and wait for their next one.
	Failing              int64   `json:"failing"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	// Owner is the relay holding a live lease on the shard; "" when none does, and then nothing
	// publishes it.
	Owner string `json:"owner"`
}

// DeadLetters is the dead-letter depth of one source.
type DeadLetters struct {
	Source           dlq.Source `json:"source"`
	Count            int64      `json:"count"`
	OldestAgeSeconds float64    `json:"oldest_age_seconds"`
}

// Dedup is one consumer's handler's dedup counts over the window.
type Dedup struct {
	inbox.DedupStat
	// AgeSeconds is how long before At counts were last added.
	AgeSeconds float64 `json:"age_seconds"`
}

// Calls are the recent failures of side-effect calls.
type Calls struct {
	// Failing are pending calls whose last attempt failed; they will be retried.
	Failing []FailingCall `json:"failing"`
	// Unsuccessful are calls completed in the window with an outcome other than succeeded.
	Unsuccessful []CallOutcome `json:"unsuccessful"`
	// DeadLetters are call letters first failed in the window: a person must reconcile them.
	DeadLetters []CallLetter `json:"dead_letters"`
}

// CallOutcome is the stored result of a call that did not succeed: declined or rejected.
type CallOutcome struct {
	IdempotencyKey string    `json:"idempotency_key"`
	Outcome        string    `json:"outcome"`
	HTTPStatus     int       `json:"http_status"`
	ObjectID       string    `json:"object_id"`
	Attempts       int       `json:"attempts"`
	CompletedAt    time.Time `json:"completed_at"`
}

// FailingCall is a pending call whose last attempt failed.
type FailingCall struct {
	ID             int64     `json:"id"`
	IdempotencyKey string    `json:"idempotency_key"`
	Shard          int       `json:"shard"`
	Attempts       int       `json:"attempts"`
	FirstAttemptAt time.Time `json:"first_attempt_at"`
	// NextAttemptAt is when it is sent again; nil when it is due now.
	NextAttemptAt *time.Time `json:"next_attempt_at"`
	LastError     string     `json:"last_error"`
}

// CallLetter is a dead-lettered call, without its request.
type CallLetter struct {
	ID             int64     `json:"id"`
	IdempotencyKey string    `json:"idempotency_key"`
	Reason         string    `json:"reason"`
	Error          string    `json:"error"`
	Attempts       int       `json:"attempts"`
	FirstFailedAt  time.Time `json:"first_failed_at"`
}

// Table is the size of one of txbox's tables.
type Table struct {
	Table      string `json:"table"`
	TotalBytes int64  `json:"total_bytes"`
	LiveRows   int64  `json:"live_rows"`
	DeadRows   int64  `json:"dead_rows"`
}

// Figure says how old one part of the report is.
type Figure struct {
	Figure string `json:"figure"`
	// AgeSeconds is how much older than At the figure may be: 0 when it was read at At.
	AgeSeconds float64 `json:"age_seconds"`
	Note       string  `json:"note"`
}

// Read takes the snapshot. It only reads: it takes no lock that a relay or a consumer waits for.
func Read(ctx context.Context, db DB, opts Options) (*Report, error) {
	if _, err := sqlname.Schema(opts.Schema); err != nil {
		return nil, fmt.Errorf("status: Options.Schema: %w", err)
	}
	if opts.Schema == "" {
		opts.Schema = sqlname.DefaultSchema
	}
	switch {
	case opts.Window == 0:
		opts.Window = DefaultWindow
	case opts.Window < 0:
		return nil, fmt.Errorf("status: Options.Window must be positive, got %s", opts.Window)
	}
	switch {
	case opts.Limit == 0:
		opts.Limit = DefaultLimit
	case opts.Limit < 0 || opts.Limit > 10000:
		return nil, fmt.Errorf("status: Options.Limit must be between 1 and 10000, got %d", opts.Limit)
	}
	admin := admins{}
	var err error
	if admin.letters, err = dlq.NewAdmin(dlq.AdminConfig{Schema: opts.Schema}); err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	if admin.outbox, err = relay.NewAdmin(relay.AdminConfig{Schema: opts.Schema}); err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}

	rep := &Report{Schema: opts.Schema, WindowSeconds: opts.Window.Seconds()}
	err = pgx.BeginTxFunc(ctx, db, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `SELECT now()`).Scan(&rep.At); err != nil {
			return err
		}
		return read(ctx, tx, opts, admin, rep)
	})
	if err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	return rep, nil
}

// admins read the tables of the outbox and of the dead letters.
type admins struct {
	outbox  *relay.Admin
	letters *dlq.Admin
}

// read fills rep from tx, a snapshot taken at rep.At.
func read(ctx context.Context, tx pgx.Tx, opts Options, admin admins, rep *Report) error {
	backlog, err := admin.outbox.Backlog(ctx, tx)
	if err != nil {
		return err
	}
	for _, b := range backlog {
		s := Shard{Shard: b.Shard, Messages: b.Messages, Calls: b.Calls, Failing: b.Failing,
			OldestPendingSeconds: b.OldestAge.Seconds(), Owner: b.Owner}
		rep.Outbox.Shards = append(rep.Outbox.Shards, s)
		rep.Outbox.Pending += s.Messages + s.Calls
		rep.Outbox.OldestPendingSeconds = max(rep.Outbox.OldestPendingSeconds, s.OldestPendingSeconds)
	}
	if rep.Leases, err = admin.outbox.Leases(ctx, tx); err != nil {
		return err
	}
	if rep.Relays, err = admin.outbox.Nodes(ctx, tx); err != nil {
		return err
	}

	depths, err := dlq.Stats(ctx, tx, opts.Schema)
	if err != nil {
		return err
	}
	for _, src := range []dlq.Source{dlq.SourceInbox, dlq.SourceRelay} {
		d := depths[src]
		rep.DeadLetters = append(rep.DeadLetters, DeadLetters{Source: src, Count: d.Count, OldestAgeSeconds: d.OldestAgeSeconds})
	}

	stats, err := inbox.DedupStats(ctx, tx, opts.Schema, opts.Window)
	if err != nil {
		return err
	}
	var dedupAge float64
	for _, s := range stats {
		age := max(rep.At.Sub(s.Updated).Seconds(), 0)
		dedupAge = max(dedupAge, age)
		rep.Dedup = append(rep.Dedup, Dedup{DedupStat: s, AgeSeconds: age})
	}

	failing, err := admin.outbox.List(ctx, tx, relay.Filter{Kind: "call", Failing: true, Limit: opts.Limit})
	if err != nil {
		return err
	}
	for _, c := range failing {
		f := FailingCall{ID: c.ID, IdempotencyKey: c.IdempotencyKey, Shard: c.Shard, Attempts: c.Attempts,
			FirstAttemptAt: c.FirstAttemptAt, LastError: c.LastError}
		if !c.NextAttemptAt.IsZero() {
			f.NextAttemptAt = &c.NextAttemptAt
		}
		rep.Calls.Failing = append(rep.Calls.Failing, f)
	}
	unsuccessful, err := admin.outbox.CallResults(ctx, tx, relay.CallResultQuery{Unsuccessful: true, Within: opts.Window, Limit: opts.Limit})
	if err != nil {
		return err
	}
	for _, c := range unsuccessful {
		rep.Calls.Unsuccessful = append(rep.Calls.Unsuccessful, CallOutcome{IdempotencyKey: c.IdempotencyKey, Outcome: c.Outcome,
			HTTPStatus: c.HTTPStatus, ObjectID: c.ObjectID, Attempts: c.Attempts, CompletedAt: c.CompletedAt})
	}
	dead, err := admin.letters.List(ctx, tx, dlq.Filter{Kind: "call", YoungerThan: opts.Window, Limit: opts.Limit})
	if err != nil {
		return err
	}
	for _, l := range dead {
		rep.Calls.DeadLetters = append(rep.Calls.DeadLetters, CallLetter{
			ID: l.ID, IdempotencyKey: l.IdempotencyKey, Reason: l.Reason, Error: l.Error,
			Attempts: l.Attempts, FirstFailedAt: l.FirstFailedAt,
		})
	}

	sizes, err := retention.TableSizes(ctx, tx, opts.Schema)
	if err != nil {
		return err
	}
	for _, s := range sizes {
		rep.Tables = append(rep.Tables, Table{Table: s.Table, TotalBytes: s.TotalBytes, LiveRows: s.LiveRows, DeadRows: s.DeadRows})
	}

	rep.Freshness = []Figure{
		{Figure: "outbox", Note: "counted at the snapshot (the txbox_outbox_* gauges are refreshed every 10s)"},
		{Figure: "leases", Note: "read at the snapshot"},
		{Figure: "relays", Note: "read at the snapshot; relays register every lease TTL / 3"},
		{Figure: "dead_letters", Note: "read at the snapshot"},
		{Figure: "dedup", AgeSeconds: dedupAge, Note: "inboxes add their counts every StatsInterval (5s); the last interval is not in yet"},
		{Figure: "calls", Note: "read at the snapshot"},
		{Figure: "tables", Note: "sizes read at the snapshot; row counts are statistics-collector estimates"},
	}
	return nil
}
