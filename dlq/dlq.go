package dlq

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txbox/txbox/internal/pgtext"
	"github.com/txbox/txbox/internal/sqlname"
)

// Source says which component gave up on a dead letter.
type Source string

const (
	// SourceInbox marks a message a consumer could not process.
	SourceInbox Source = "inbox"
	// SourceRelay marks an outbox row the relay could not publish or must not execute again.
	SourceRelay Source = "relay"
)

// Entry is one dead letter.
type Entry struct {
	Source Source
	// Kind is "message" or "call"; empty means "message".
	Kind string
	// Topic is where the message was consumed from (source "inbox") or was to be published to
	// (source "relay"); a redrive publishes it there. For a call it is the reply topic.
	Topic string
	// Consumer, Handler and DedupKey identify the consumer's inbox row: Handler is the router
	// handler that gave up on the message ("" outside a router, and for letters written before
	// deduplication was per handler). All three are empty for relay letters.
	Consumer       string
	Handler        string
	DedupKey       string
	PartitionKey   string
	UUID           string
	Payload        []byte
	Metadata       map[string]string
	IdempotencyKey string
	// Reason is short and stable, for filtering and alerting: "attempts exhausted", "payload too large".
	Reason string
	// Error is the last error in full.
	Error    string
	Attempts int
	// FirstFailedAt is when the message first failed, if that was before now: the first refused
	// attempt of a relay row, say. Zero means now.
	FirstFailedAt time.Time
}

// Execer is the part of pgx the writer needs; a pgx.Tx satisfies it.
type Execer interface {
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
}

// Writer adds dead letters. Components write them in the same transaction as the state change that
// gives up on the message, so a message is never both pending and dead, nor neither.
type Writer struct {
	insert, callFirstSent string
}

// NewWriter returns a Writer for the tables in schema ("" means "public").
func NewWriter(schema string) (*Writer, error) {
	quoted, err := sqlname.Schema(schema)
	if err != nil {
		return nil, fmt.Errorf("dlq: %w", err)
	}
	return &Writer{insert: sqlname.Render(insertSQL, quoted), callFirstSent: sqlname.Render(callFirstSentSQL, quoted)}, nil
}

// Add writes e through tx.
func (w *Writer) Add(ctx context.Context, tx Execer, e Entry) error {
	kind := e.Kind
	if kind == "" {
		kind = "message"
	}
	// A dead letter must always be storable: text the database would refuse is repaired, since
	// failing here would leave the message failing on every delivery instead.
	meta := make(map[string]string, len(e.Metadata))
	for k, v := range e.Metadata {
		meta[pgtext.Sanitize(k)] = pgtext.Sanitize(v)
	}
	metaJSON, err := json.Marshal(meta)
	if err != nil {
		return fmt.Errorf("dlq: encode metadata: %w", err)
	}
	var idem *string
	if e.IdempotencyKey != "" {
		idem = &e.IdempotencyKey
	}
	payload := e.Payload
	if payload == nil {
		payload = []byte{}
	}
	_, err = tx.Exec(ctx, w.insert, string(e.Source), kind, e.Topic, e.Consumer, e.DedupKey, pgtext.Sanitize(e.PartitionKey),
		pgtext.Sanitize(e.UUID), payload, string(metaJSON), idem, e.Reason, pgtext.Sanitize(e.Error), e.Attempts, e.Handler,
		pgtype.Timestamptz{Time: e.FirstFailedAt, Valid: !e.FirstFailedAt.IsZero()})
	if err != nil {
		return fmt.Errorf("dlq: add %s letter for %s: %w", e.Source, e.UUID, err)
	}
	return nil
}

// Querier is the part of pgx the read side needs; *pgxpool.Pool satisfies it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// CallFirstSent returns when the first call letter with idempotencyKey that had been sent at least
// once was first sent, and false when there is none. A provider forgets an idempotency key a fixed
// time after it first saw it, whichever call sent it: a writer of calls measures the key's age
// from its dead-lettered calls too, or a call written again with the key of one that was buried
// after reaching the provider would be sent once the provider had forgotten the key, and executed
// twice. Letters discarded (Admin.Discard) no longer count.
func (w *Writer) CallFirstSent(ctx context.Context, db Querier, idempotencyKey string) (time.Time, bool, error) {
	var first pgtype.Timestamptz
	if err := db.QueryRow(ctx, w.callFirstSent, idempotencyKey).Scan(&first); err != nil {
		return time.Time{}, false, fmt.Errorf("dlq: first sending of the call letters with key %q: %w", idempotencyKey, err)
	}
	return first.Time, first.Valid, nil
}

// Depth is the number of dead letters from one source and the age of the oldest, in seconds.
type Depth struct {
	Count            int64
	OldestAgeSeconds float64
}

// Stats returns the dead-letter depth per source, by the database's clock.
func Stats(ctx context.Context, db Querier, schema string) (map[Source]Depth, error) {
	quoted, err := sqlname.Schema(schema)
	if err != nil {
		return nil, fmt.Errorf("dlq: %w", err)
	}
	var in, out Depth
	err = db.QueryRow(ctx, sqlname.Render(statsSQL, quoted)).Scan(&in.Count, &in.OldestAgeSeconds, &out.Count, &out.OldestAgeSeconds)
	if err != nil {
		return nil, fmt.Errorf("dlq: stats: %w", err)
	}
	return map[Source]Depth{SourceInbox: in, SourceRelay: out}, nil
}
