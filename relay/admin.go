package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/outbox"
)

// ErrRowNotFound is returned, wrapped, by Admin.Get and Admin.Bury for an id that is not in the
// outbox: it never was, or it was published, executed or buried meanwhile.
var ErrRowNotFound = errors.New("relay: no such pending outbox row")

// Bounds of Admin.Bury's transaction: it waits this long at most for the shard's lease row, which a
// relay holds only for the few milliseconds of a completion, or for LeaseTTL/3 when it froze
// holding it.
const (
	adminLockTimeout = 10 * time.Second
	adminStatement   = 30 * time.Second
	adminIdle        = 30 * time.Second
)

// AdminConfig configures an Admin.
type AdminConfig struct {
	// Schema is the PostgreSQL schema holding txbox's tables. If not specified, defaults to "public".
	Schema string
	// Shards is the layout rows are grouped by (Backlog, Row.Shard, Filter.Shards). If not
	// specified, the layout of the lease table, which is the running relays' (Config.Shards), or
	// DefaultShards when no relay ever ran. If set, it must divide 256.
	Shards int
}

// Admin inspects the outbox and moves a row to the dead-letter table by hand: the library side of
// `txbox outbox list|show|bury`. Its methods take the database as an argument, like River's: a
// pool, a connection, or a transaction of the caller's. It is safe for concurrent use.
type Admin struct {
	shards  int // 0: the lease table's layout
	sql     adminQueries
	dead    *dlq.Writer
	replies *outbox.Writer // a buried call's reply
}

// NewAdmin validates cfg and returns an Admin.
func NewAdmin(cfg AdminConfig) (*Admin, error) {
	schema, err := sqlname.Schema(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("relay: AdminConfig.Schema: %w", err)
	}
	if cfg.Shards < 0 || cfg.Shards > outbox.Slots || cfg.Shards > 0 && outbox.Slots%cfg.Shards != 0 {
		return nil, fmt.Errorf("relay: AdminConfig.Shards must divide %d (1, 2, 4, ... 256), got %d", outbox.Slots, cfg.Shards)
	}
	dead, err := dlq.NewWriter(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	replies, err := outbox.New(outbox.Config{Schema: cfg.Schema})
	if err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	return &Admin{shards: cfg.Shards, sql: renderAdminQueries(schema), dead: dead, replies: replies}, nil
}

// Queryer is the part of pgx that the admin's reads need; *pgxpool.Pool, *pgx.Conn and pgx.Tx
// satisfy it.
type Queryer interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// TxBeginner is the part of pgx that Admin.Bury needs: it runs one transaction. *pgxpool.Pool and
// *pgx.Conn satisfy it; so does pgx.Tx, whose transaction becomes a savepoint.
type TxBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// ShardBacklog is what is pending in one shard.
type ShardBacklog struct {
	Shard int
	// Messages and Calls count the pending rows of each kind.
	Messages, Calls int64
	// Failing counts the rows whose last attempt failed: messages the broker refused, waiting for
	// their next attempt (they hold back the later messages of their key), and calls being
	// retried.
	Failing int64
	// OldestAge is the age of the shard's oldest pending row by the database's clock; 0 when the
	// shard has none.
	OldestAge time.Duration
	// Owner is the relay holding a live lease on the shard; "" when none does, and then nothing
	// publishes the shard.
	Owner string
}

// Backlog returns every shard of the layout, in order, empty ones included.
func (a *Admin) Backlog(ctx context.Context, db Queryer) ([]ShardBacklog, error) {
	rows, err := db.Query(ctx, a.sql.backlog, a.layout())
	if err != nil {
		return nil, fmt.Errorf("relay: backlog: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ShardBacklog, error) {
		var b ShardBacklog
		var oldestMs int64
		err := row.Scan(&b.Shard, &b.Messages, &b.Calls, &b.Failing, &oldestMs, &b.Owner)
		b.OldestAge = time.Duration(oldestMs) * time.Millisecond
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("relay: backlog: %w", err)
	}
	return out, nil
}

// Row is one pending outbox row.
type Row struct {
	ID int64
	// Kind is "message" or "call".
	Kind  string
	Shard int
	// Topic is where a message is to be published, or where a call's reply goes ("" for none).
	Topic          string
	PartitionKey   string
	UUID           string
	IdempotencyKey string // calls only
	Metadata       map[string]string
	// Payload is the message, or the call's encoded request. Get fills it; List leaves it nil and
	// gives only PayloadBytes, its size.
	Payload      []byte
	PayloadBytes int
	// Attempts counts the publish attempts the broker refused (messages) or the sends (calls).
	Attempts int
	// FirstAttemptAt is zero until an attempt was counted.
	FirstAttemptAt time.Time
	// NextAttemptAt is when a failing row is tried again; zero when it is due now.
	NextAttemptAt time.Time
	// LastError is the last failure, "" when none.
	LastError string
	CreatedAt time.Time
	// Age is how long the row has been pending, by the database's clock.
	Age time.Duration
}

// Filter selects pending rows. Conditions combine with AND; a zero field leaves its condition open.
type Filter struct {
	// Shards selects the rows of these shards (of the Admin's layout).
	Shards []int
	// Kind selects "message" or "call" rows.
	Kind string
	// Topic selects the rows of one topic (calls: reply topic).
	Topic string
	// PartitionKey selects the rows of one key.
	PartitionKey string
	// Failing selects the rows whose last attempt failed (see ShardBacklog.Failing).
	Failing bool
	// OlderThan selects the rows pending at least this long.
	OlderThan time.Duration
	// AfterID selects the rows with a higher id: pass the last id of a page to get the next.
	AfterID int64
	// Limit is the most rows returned, lowest ids first. If not specified, defaults to 100; at
	// most 10000.
	Limit int
}

func (f Filter) args(layout any) ([]any, error) {
	switch {
	case f.Kind != "" && f.Kind != "message" && f.Kind != "call":
		return nil, fmt.Errorf("relay: Filter.Kind must be \"message\" or \"call\", got %q", f.Kind)
	case f.OlderThan < 0:
		return nil, fmt.Errorf("relay: Filter.OlderThan must not be negative, got %s", f.OlderThan)
	case f.AfterID < 0:
		return nil, fmt.Errorf("relay: Filter.AfterID must not be negative, got %d", f.AfterID)
	case f.Limit < 0 || f.Limit > 10000:
		return nil, fmt.Errorf("relay: Filter.Limit must be between 1 and 10000 (0 means 100), got %d", f.Limit)
	}
	for _, s := range f.Shards {
		if s < 0 || s >= outbox.Slots {
			return nil, fmt.Errorf("relay: Filter.Shards: no shard %d", s)
		}
	}
	opt := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	var shards, older any
	if len(f.Shards) > 0 {
		shards = f.Shards
	}
	if f.OlderThan > 0 {
		older = f.OlderThan.Milliseconds()
	}
	limit := f.Limit
	if limit == 0 {
		limit = 100
	}
	return []any{layout, shards, opt(f.Kind), opt(f.Topic), opt(f.PartitionKey), f.Failing, older, f.AfterID, limit}, nil
}

// List returns the pending rows f selects, lowest ids first, without their payloads.
func (a *Admin) List(ctx context.Context, db Queryer, f Filter) ([]Row, error) {
	args, err := f.args(a.layout())
	if err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, a.sql.list, args...)
	if err != nil {
		return nil, fmt.Errorf("relay: list outbox: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Row, error) { return scanRow(row) })
	if err != nil {
		return nil, fmt.Errorf("relay: list outbox: %w", err)
	}
	return out, nil
}

// Get returns one pending row with its payload, or an error wrapping ErrRowNotFound.
func (a *Admin) Get(ctx context.Context, db Queryer, id int64) (Row, error) {
	row, err := scanRow(db.QueryRow(ctx, a.sql.get, a.layout(), id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Row{}, fmt.Errorf("%w: id %d", ErrRowNotFound, id)
	}
	if err != nil {
		return Row{}, fmt.Errorf("relay: get outbox row %d: %w", id, err)
	}
	return row, nil
}

// Bury moves one pending row to the dead-letter table by hand, with reason (required: why a person
// gave up on it) as the letter's error and ReasonBuried as its reason, and returns the row as it
// was. Like the relay's own state changes, it runs in a transaction that first locks the lease row
// of the row's shard, so a relay completing the row at the same moment either committed first
// (Bury then returns ErrRowNotFound) or waits for Bury and then completes nothing: a row is never
// both completed and dead, nor dead twice. What it cannot stop is a send already under way: a
// message a relay is publishing at that moment may reach the broker too (consumers drop the copy a
// redrive makes later), and a call it is sending may reach the provider. The relay then keeps the
// provider's answer when it comes, as the key's result, replies with it after the burial's reply,
// and logs an error: reconcile the letter with it. A buried call with a reply topic replies in the
// same transaction, with outcome outbox.OutcomeDeadLettered and ReasonBuried as its error's code,
// as a call the relay dead-letters does: whoever waits for the reply would otherwise wait for ever.
func (a *Admin) Bury(ctx context.Context, db TxBeginner, id int64, reason string) (Row, error) {
	if strings.TrimSpace(reason) == "" {
		return Row{}, errors.New("relay: Bury needs a reason, for whoever reads the letter")
	}
	var buried Row
	err := inBoundedTx(ctx, db, adminLockTimeout, adminStatement, adminIdle, nil, func(tx pgx.Tx) error {
		var shard int
		// No lease row (no relay ever ran) means nothing to wait for.
		if err := tx.QueryRow(ctx, a.sql.lockLeaseOf, id).Scan(&shard); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("lock the shard's lease: %w", err)
		}
		row, err := a.Get(ctx, tx, id)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, a.sql.deleteRow, id); err != nil {
			return err
		}
		detail := reason
		if row.LastError != "" {
			detail += "\nlast error: " + row.LastError
		}
		buried = row
		letter := dlq.Entry{
			Source: dlq.SourceRelay, Kind: row.Kind, Topic: row.Topic, PartitionKey: row.PartitionKey, UUID: row.UUID,
			Payload: row.Payload, Metadata: row.Metadata, IdempotencyKey: row.IdempotencyKey,
			Reason: ReasonBuried, Error: detail, Attempts: row.Attempts, FirstFailedAt: row.FirstAttemptAt,
		}
		if err := a.dead.Add(ctx, tx, letter); err != nil || row.Kind != "call" {
			return err
		}
		return replyDeadLettered(ctx, a.replies, tx, id, letter)
	})
	if err != nil {
		if errors.Is(err, ErrRowNotFound) {
			return Row{}, err
		}
		return Row{}, fmt.Errorf("relay: bury outbox row %d: %w", id, err)
	}
	return buried, nil
}

// layout is the $1 of the admin's queries: the configured shard count, or NULL for the lease
// table's.
func (a *Admin) layout() any {
	if a.shards == 0 {
		return nil
	}
	return a.shards
}

// scanRow reads the columns of rowColumns.
func scanRow(row pgx.Row) (Row, error) {
	var (
		r           Row
		meta        string
		first, next *time.Time
		ageMs       int64
	)
	err := row.Scan(&r.ID, &r.Kind, &r.Shard, &r.Topic, &r.PartitionKey, &r.UUID, &r.IdempotencyKey, &meta,
		&r.Payload, &r.PayloadBytes, &r.Attempts, &first, &next, &r.LastError, &r.CreatedAt, &ageMs)
	if err != nil {
		return Row{}, err
	}
	if first != nil {
		r.FirstAttemptAt = *first
	}
	if next != nil {
		r.NextAttemptAt = *next
	}
	r.Age = time.Duration(ageMs) * time.Millisecond
	// Written by the outbox from a map[string]string: it decodes.
	_ = json.Unmarshal([]byte(meta), &r.Metadata)
	if r.Metadata == nil {
		r.Metadata = map[string]string{}
	}
	return r, nil
}
