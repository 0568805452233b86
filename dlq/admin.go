package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/outbox"
)

// Sentinel errors of the admin API, returned wrapped; test them with errors.Is.
var (
	// ErrNotFound is returned by Get for an id that is not in the table.
	ErrNotFound = errors.New("dlq: no such letter")
	// ErrEmptyFilter is returned by Discard and Redrive for a filter that selects every letter
	// without saying so with Filter.All, so a forgotten flag cannot empty the table.
	ErrEmptyFilter = errors.New("dlq: the filter selects every letter; set Filter.All to mean it")
	// ErrCallNotRedrivable is returned by Redrive when the filter selects a side-effect call (a
	// relay letter of kind "call"). A call may have reached the provider already, or its
	// idempotency key may have expired there: a person reconciles it with the provider and then
	// discards the letter. Exclude calls with Filter.Kind = "message".
	ErrCallNotRedrivable = errors.New("dlq: side-effect calls cannot be redriven; reconcile them with the provider by hand, then discard them")
	// ErrNoMessageID is returned by Redrive when the filter selects the letter of a message that
	// had no usable id (reason ReasonNoID of the inbox): the outbox publishes only messages with
	// an id, of at most outbox.MaxUUIDBytes. Publish what should still be processed yourself, then discard the letter.
	ErrNoMessageID = errors.New("dlq: letters of messages without an id cannot be redriven; publish their payloads again yourself if they should be processed, then discard them")
	// ErrNoTopic is returned by Redrive when the filter selects the letter of a message whose topic
	// is not known: an inbox used outside a Watermill router cannot tell which topic a message came
	// from. Publish what should still be processed yourself, then discard the letter.
	// ErrTooLarge is returned by Redrive when the filter selects a letter whose payload is over the
	// outbox's limit (AdminConfig.Outbox's MaxPayloadBytes): the inbox dead-letters messages over
	// its own limit, and the outbox would refuse them the same way.
	ErrTooLarge = errors.New("dlq: letters whose payload is over the outbox's limit cannot be redriven; discard them, or redrive through an outbox.Writer with a higher MaxPayloadBytes")
	ErrNoTopic  = errors.New("dlq: letters of messages without a topic cannot be redriven; publish their payloads again yourself if they should be processed, then discard them")
)

// Letter is one dead letter as stored: the Entry a component added, its id and its failure times.
type Letter struct {
	// ID identifies the letter in the admin API and the CLI.
	ID int64
	Entry
	FirstFailedAt time.Time
	LastFailedAt  time.Time
}

// Filter selects dead letters. Conditions combine with AND; a zero field leaves its condition open.
type Filter struct {
	// Source selects letters from one component.
	Source Source
	// Kind selects "message" or "call" letters.
	Kind string
	// Topic selects letters of one topic.
	Topic string
	// Consumer selects the letters of one consumer (inbox letters).
	Consumer string
	// Handler selects the letters of one router handler (inbox letters).
	Handler string
	// Reason selects letters whose reason contains it, ignoring case.
	Reason string
	// OlderThan selects letters that first failed at least this long ago, by the database's clock.
	OlderThan time.Duration
	// YoungerThan selects letters that first failed less than this long ago.
	YoungerThan time.Duration
	// IDs selects these letters.
	IDs []int64
	// Limit selects at most this many letters, lowest ids first. Zero means no limit.
	Limit int
	// MaxID selects letters whose id is at most MaxID; zero leaves it open. Letters get ascending
	// ids, so a change to the selection a person saw, bounded by the highest id there was then
	// (Admin.MaxID), cannot reach letters added since, which the person did not see. Like Limit,
	// it is no condition for IsEmpty.
	MaxID int64
	// All states that a filter without conditions is meant to select every letter. Discard and
	// Redrive refuse an empty filter without it (ErrEmptyFilter).
	All bool
}

// IsEmpty reports whether f has no condition, so that it selects every letter. Limit does not count:
// "the first 1000 letters" is an arbitrary choice, not a selection.
func (f Filter) IsEmpty() bool {
	return f.Source == "" && f.Kind == "" && f.Topic == "" && f.Consumer == "" && f.Handler == "" && f.Reason == "" &&
		f.OlderThan == 0 && f.YoungerThan == 0 && len(f.IDs) == 0
}

func (f Filter) validate() error {
	switch {
	case f.Source != "" && f.Source != SourceInbox && f.Source != SourceRelay:
		return fmt.Errorf("dlq: Filter.Source must be %q or %q, got %q", SourceInbox, SourceRelay, f.Source)
	case f.Kind != "" && f.Kind != "message" && f.Kind != "call":
		return fmt.Errorf("dlq: Filter.Kind must be \"message\" or \"call\", got %q", f.Kind)
	case f.OlderThan < 0:
		return fmt.Errorf("dlq: Filter.OlderThan must not be negative, got %s", f.OlderThan)
	case f.YoungerThan < 0:
		return fmt.Errorf("dlq: Filter.YoungerThan must not be negative, got %s", f.YoungerThan)
	case f.Limit < 0:
		return fmt.Errorf("dlq: Filter.Limit must not be negative, got %d", f.Limit)
	case f.MaxID < 0:
		return fmt.Errorf("dlq: Filter.MaxID must not be negative, got %d", f.MaxID)
	}
	return nil
}

// window narrows a filter to an id range at a fixed time, for walks in batches.
type window struct {
	asOf          *time.Time
	after, atMost *int64
	limit         int
}

// args returns the parameters of filterSQL and the limit ($1…$13).
func (f Filter) args(w window) []any {
	opt := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	micros := func(d time.Duration) any {
		if d == 0 {
			return nil
		}
		return d.Microseconds()
	}
	var ids, limit any
	if len(f.IDs) > 0 {
		ids = f.IDs
	}
	if w.limit > 0 {
		limit = w.limit
	}
	atMost := w.atMost
	if f.MaxID > 0 && (atMost == nil || *atMost > f.MaxID) {
		atMost = &f.MaxID
	}
	return []any{
		opt(string(f.Source)), opt(f.Kind), opt(f.Topic), opt(f.Consumer), opt(f.Reason),
		micros(f.OlderThan), micros(f.YoungerThan), w.asOf, ids, w.after, atMost, limit, opt(f.Handler),
	}
}

// Queryer is the part of pgx that List needs; *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Queryer interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// TxBeginner is the part of pgx that Redrive needs: it runs one transaction per batch.
// *pgxpool.Pool and *pgx.Conn satisfy it; so does pgx.Tx, whose batches become savepoints.
type TxBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// AdminConfig configures an Admin.
type AdminConfig struct {
	// Schema is the PostgreSQL schema holding txbox's tables. If not specified, defaults to "public".
	Schema string
	// Outbox writes redriven messages. If not specified, one is made for Schema.
	Outbox *outbox.Writer
}

// Admin inspects, redrives and discards dead letters. It is safe for concurrent use.
type Admin struct {
	outbox *outbox.Writer
	sql    adminQueries
}

type adminQueries struct {
	list, get, count, maxID, discard, plan, lockBatch, releaseDead, recordRedrive, deleteLetters string
}

// NewAdmin validates cfg and returns an Admin.
func NewAdmin(cfg AdminConfig) (*Admin, error) {
	quoted, err := sqlname.Schema(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("dlq: AdminConfig.Schema: %w", err)
	}
	if cfg.Outbox == nil {
		if cfg.Outbox, err = outbox.New(outbox.Config{Schema: cfg.Schema}); err != nil {
			return nil, fmt.Errorf("dlq: %w", err)
		}
	}
	r := func(s string) string { return sqlname.Render(s, quoted) }
	return &Admin{
		outbox: cfg.Outbox,
		sql: adminQueries{
			list: r(listSQL), get: r(getSQL), count: r(countSQL), maxID: r(maxIDSQL), discard: r(discardSQL),
			plan: r(planSQL), lockBatch: r(lockBatchSQL), releaseDead: r(releaseDeadSQL),
			recordRedrive: r(recordRedriveSQL), deleteLetters: r(deleteLettersSQL),
		},
	}, nil
}

// List returns the letters f selects, lowest ids first, payloads included: set Filter.Limit when
// the table may be large.
func (a *Admin) List(ctx context.Context, db Queryer, f Filter) ([]Letter, error) {
	if err := f.validate(); err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, a.sql.list, f.args(window{limit: f.Limit})...)
	if err != nil {
		return nil, fmt.Errorf("dlq: list: %w", err)
	}
	letters, err := collectLetters(rows)
	if err != nil {
		return nil, fmt.Errorf("dlq: list: %w", err)
	}
	return letters, nil
}

// Get returns one letter, or an error wrapping ErrNotFound.
func (a *Admin) Get(ctx context.Context, db Querier, id int64) (Letter, error) {
	l, err := scanLetter(db.QueryRow(ctx, a.sql.get, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Letter{}, fmt.Errorf("%w: id %d", ErrNotFound, id)
	}
	if err != nil {
		return Letter{}, fmt.Errorf("dlq: get %d: %w", id, err)
	}
	return l, nil
}

// MaxID returns the highest letter id there is (0 when there has been none), for Filter.MaxID.
func (a *Admin) MaxID(ctx context.Context, db Querier) (int64, error) {
	var id int64
	if err := db.QueryRow(ctx, a.sql.maxID).Scan(&id); err != nil {
		return 0, fmt.Errorf("dlq: highest letter id: %w", err)
	}
	return id, nil
}

// Count returns how many letters f selects, at most Filter.Limit when that is set.
func (a *Admin) Count(ctx context.Context, db Querier, f Filter) (int, error) {
	if err := f.validate(); err != nil {
		return 0, err
	}
	var n int
	if err := db.QueryRow(ctx, a.sql.count, f.args(window{limit: f.Limit})...).Scan(&n); err != nil {
		return 0, fmt.Errorf("dlq: count: %w", err)
	}
	return n, nil
}

// Discard deletes the letters f selects and returns how many it deleted. The inbox keeps the
// consumers' 'dead' rows of discarded letters, so the broker's redeliveries of those messages are
// still skipped; the retention package removes them once the broker can no longer redeliver.
// An empty filter is refused unless Filter.All is set (ErrEmptyFilter).
func (a *Admin) Discard(ctx context.Context, db Execer, f Filter) (int, error) {
	if err := f.validate(); err != nil {
		return 0, err
	}
	if f.IsEmpty() && !f.All {
		return 0, ErrEmptyFilter
	}
	tag, err := db.Exec(ctx, a.sql.discard, f.args(window{limit: f.Limit})...)
	if err != nil {
		return 0, fmt.Errorf("dlq: discard: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

func collectLetters(rows pgx.Rows) ([]Letter, error) {
	defer rows.Close()
	var out []Letter
	for rows.Next() {
		l, err := scanLetter(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	return out, rows.Err()
}

// scanLetter reads the columns of letterColumns.
func scanLetter(row pgx.Row) (Letter, error) {
	var (
		l      Letter
		source string
		meta   string
	)
	err := row.Scan(&l.ID, &source, &l.Kind, &l.Topic, &l.Consumer, &l.Handler, &l.DedupKey, &l.PartitionKey, &l.UUID,
		&l.Payload, &meta, &l.IdempotencyKey, &l.Reason, &l.Error, &l.Attempts, &l.FirstFailedAt, &l.LastFailedAt)
	if err != nil {
		return Letter{}, err
	}
	l.Source = Source(source)
	if err := json.Unmarshal([]byte(meta), &l.Metadata); err != nil {
		return Letter{}, fmt.Errorf("letter %d: decode metadata: %w", l.ID, err)
	}
	if l.Metadata == nil {
		l.Metadata = map[string]string{}
	}
	return l, nil
}
