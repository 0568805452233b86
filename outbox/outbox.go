package outbox

import (
	"context"
	"errors"
	"fmt"
	"reflect"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txbox/txbox/internal/pgtext"
	"github.com/txbox/txbox/internal/sqlname"
)

// Execer is the part of pgx the outbox needs. pgx.Tx satisfies it, and so do *pgx.Conn and
// *pgxpool.Pool for writes that need no transaction of their own. A wrapper of one must return
// the command tag it got: Call reads the rows a write affected.
type Execer interface {
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
}

// Slots is the number of slots the outbox hashes partition keys into. It is part of the stored
// format and never changes; relay shards are sets of slots.
const Slots = 256

// PartitionKeyMetadata is the metadata key that carries a message's partition key. The relay uses it
// as the Kafka record key, and the outbox uses it to keep messages with one key in order.
const PartitionKeyMetadata = "txbox_partition_key"

// Metadata keys the relay sets on every message it publishes: the shard and the fencing token of
// the lease it held. The inbox records them so an audit can tell which lease published what.
const (
	ShardMetadata = "txbox_shard"
	TokenMetadata = "txbox_token"
)

// DefaultMaxPayloadBytes is the payload limit when Config.MaxPayloadBytes is zero: Kafka's default
// maximum record size, less room for headers.
const DefaultMaxPayloadBytes = 1000 * 1000

// MaxUUIDBytes is the longest message UUID the outbox takes. The inbox keys its rows by it (the
// default dedup key), with the consumer and handler names, in a B-tree index whose entries hold at
// most 2,704 bytes: a longer id could be neither recorded nor processed by a consumer.
const MaxUUIDBytes = 1024

// ReservedMetadata is the metadata key Publish refuses: watermill-kafka's marshaler stores the
// message UUID under it.
const ReservedMetadata = "_watermill_message_uuid"

// ErrInvalidMessage is returned (wrapped) for a message that can never be published: no topic, no
// UUID, a reserved metadata key, or a payload over the limit. Nothing is written for the call.
var ErrInvalidMessage = errors.New("outbox: invalid message")

// ErrSchemaOutdated is returned (wrapped) when the schema lacks a table, a column or an index this
// version's statements need: a migration is pending, as when new writers are deployed before
// txbox migrate up runs, or txbox is not installed there. The message is not at fault: the inbox
// gives the delivery's attempt back, so the message waits for the migration, not the DLQ.
var ErrSchemaOutdated = errors.New("outbox: the schema lacks a migration this txbox needs (or txbox is not installed in it); run txbox migrate up")

// Config configures a Writer.
type Config struct {
	// Schema is the PostgreSQL schema holding txbox's tables. If not specified, defaults to "public".
	Schema string
	// MaxPayloadBytes rejects larger payloads when they are written, rather than when the broker
	// refuses them. If not specified, defaults to DefaultMaxPayloadBytes.
	MaxPayloadBytes int
}

// Writer writes messages into the outbox. It is safe for concurrent use.
type Writer struct {
	insertMessage     string
	insertMessages    string
	insertCall        string
	insertDerivedCall string
	maxPayloadBytes   int
}

// New validates cfg and returns a Writer.
func New(cfg Config) (*Writer, error) {
	schema, err := sqlname.Schema(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("outbox: Config.Schema: %w", err)
	}
	if cfg.MaxPayloadBytes < 0 {
		return nil, fmt.Errorf("outbox: Config.MaxPayloadBytes must not be negative, got %d", cfg.MaxPayloadBytes)
	}
	if cfg.MaxPayloadBytes == 0 {
		cfg.MaxPayloadBytes = DefaultMaxPayloadBytes
	}
	return &Writer{
		insertMessage:     sqlname.Render(insertMessageSQL, schema),
		insertMessages:    sqlname.Render(insertMessagesSQL, schema),
		insertCall:        sqlname.Render(insertCallSQL, schema),
		insertDerivedCall: sqlname.Render(insertDerivedCallSQL, schema),
		maxPayloadBytes:   cfg.MaxPayloadBytes,
	}, nil
}

// MaxPayloadBytes is the largest payload the Writer takes (Config.MaxPayloadBytes, resolved).
func (w *Writer) MaxPayloadBytes() int { return w.maxPayloadBytes }

// SetPartitionKey sets the key that orders msg relative to other messages with the same key and
// becomes its Kafka record key. It returns msg for chaining.
func SetPartitionKey(msg *message.Message, key string) *message.Message {
	msg.Metadata.Set(PartitionKeyMetadata, key)
	return msg
}

// Publish writes msgs for topic into the outbox through tx. The trace context of ctx is stored in
// each message's metadata (through the global OpenTelemetry propagator) so the consumer continues
// the trace. Nothing is written if any message is invalid.
func (w *Writer) Publish(ctx context.Context, tx Execer, topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	if err := checkExecer(tx); err != nil {
		return err
	}
	if topic == "" {
		return fmt.Errorf("%w: empty topic", ErrInvalidMessage)
	}
	if err := checkText(ErrInvalidMessage, "topic", topic); err != nil {
		return err
	}
	for i, msg := range msgs {
		if err := w.validate(msg); err != nil {
			if len(msgs) > 1 {
				return fmt.Errorf("%w (message %d of %d; nothing was written)", err, i+1, len(msgs))
			}
			return err
		}
	}
	trace := traceFieldsOf(ctx)
	if len(msgs) == 1 {
		// Most transactions write one message: a plain single-row INSERT, no arrays to encode and
		// unpack.
		msg := msgs[0]
		key := msg.Metadata.Get(PartitionKeyMetadata)
		meta := string(appendMetadata(make([]byte, 0, metadataSizeHint), msg.Metadata, trace))
		if _, err := tx.Exec(ctx, w.insertMessage, topic, SlotOf(key, msg.UUID), key, msg.UUID, payloadOf(msg), meta); err != nil {
			return insertError(fmt.Sprintf("1 message for %q", topic), err)
		}
		return nil
	}
	var (
		slots    = make([]int16, len(msgs))
		keys     = make([]string, len(msgs))
		uuids    = make([]string, len(msgs))
		payloads = make([][]byte, len(msgs))
		metas    = make([]string, len(msgs))
		ends     = make([]int, len(msgs))
		buf      = make([]byte, 0, len(msgs)*metadataSizeHint)
	)
	for i, msg := range msgs {
		keys[i] = msg.Metadata.Get(PartitionKeyMetadata)
		slots[i] = SlotOf(keys[i], msg.UUID)
		uuids[i] = msg.UUID
		payloads[i] = payloadOf(msg)
		// All metadata goes into one buffer; it is sliced once complete, as appends move it. It is
		// passed as text, not []byte: pgx sends []byte as bytea in its simple-protocol and exec
		// modes (PgBouncer's), which a text column would store as the hex of the JSON.
		buf = appendMetadata(buf, msg.Metadata, trace)
		ends[i] = len(buf)
	}
	all, start := string(buf), 0
	for i, end := range ends {
		metas[i] = all[start:end]
		start = end
	}
	if _, err := tx.Exec(ctx, w.insertMessages, topic, slots, keys, uuids, payloads, metas); err != nil {
		return insertError(fmt.Sprintf("%d message(s) for %q", len(msgs), topic), err)
	}
	return nil
}

// insertError wraps the error of an insert of what. One that says the table is not the one this
// version's statements were written for is ErrSchemaOutdated too; the statements are txbox's own
// and their arguments typed by it, so nothing a caller passes raises these.
func insertError(what string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "42P01", // undefined_table
			"42703", // undefined_column: writer_xact, before migration 00014
			"42804", // datatype_mismatch: metadata still jsonb, before migration 00010
			"42P10": // invalid_column_reference: no unique index for ON CONFLICT, before migration 00014
			return fmt.Errorf("outbox: insert %s: %w: %w", what, ErrSchemaOutdated, err)
		}
	}
	return fmt.Errorf("outbox: insert %s: %w", what, err)
}

// checkExecer refuses a nil tx, which would otherwise panic deep in the write.
func checkExecer(tx Execer) error {
	given := any(tx)
	if s, ok := tx.(sqlExecer); ok {
		given = s.tx // FromSQL of a nil *sql.Tx is not nil itself.
	}
	if given == nil {
		return errors.New("outbox: tx is nil")
	}
	if v := reflect.ValueOf(given); v.Kind() == reflect.Pointer && v.IsNil() {
		return fmt.Errorf("outbox: tx is a nil %T", given)
	}
	return nil
}

// metadataSizeHint is room for a partition key and a trace context, so most messages' metadata
// is encoded without growing the buffer.
const metadataSizeHint = 128

// payloadOf is msg's payload as stored: an empty payload is valid, NULL is not.
func payloadOf(msg *message.Message) []byte {
	if msg.Payload == nil {
		return []byte{}
	}
	return msg.Payload
}

func (w *Writer) validate(msg *message.Message) error {
	switch {
	case msg == nil:
		return fmt.Errorf("%w: nil message", ErrInvalidMessage)
	case msg.UUID == "":
		return fmt.Errorf("%w: empty UUID", ErrInvalidMessage)
	case len(msg.UUID) > MaxUUIDBytes:
		return fmt.Errorf("%w: UUID of %d bytes is over the %d-byte limit", ErrInvalidMessage, len(msg.UUID), MaxUUIDBytes)
	case len(msg.Payload) > w.maxPayloadBytes:
		return fmt.Errorf("%w: %s: payload of %d bytes is over the %d-byte limit", ErrInvalidMessage, msg.UUID, len(msg.Payload), w.maxPayloadBytes)
	}
	if err := checkText(ErrInvalidMessage, "UUID", msg.UUID); err != nil {
		return err
	}
	// The partition key is metadata too.
	if err := checkMetadata(ErrInvalidMessage, "metadata", msg.Metadata); err != nil {
		return fmt.Errorf("%w (message %s)", err, msg.UUID)
	}
	return nil
}

// checkText refuses text that PostgreSQL's text and jsonb types cannot store and that encoding/json
// would silently rewrite: NUL characters and invalid UTF-8. Publish and Call check every piece of
// text they store with it and checkMetadata, so both refuse the same things; what names the field
// in the error, which wraps invalid.
func checkText(invalid error, what, value string) error {
	if pgtext.Valid(value) {
		return nil
	}
	return fmt.Errorf("%w: %s %q is not valid UTF-8 or contains NUL", invalid, what, value)
}

// checkMetadata checks metadata keys and values with checkText and refuses the key under which
// watermill-kafka's marshaler stores the message UUID.
func checkMetadata(invalid error, what string, md map[string]string) error {
	for k, v := range md {
		if k == ReservedMetadata {
			return fmt.Errorf("%w: %s: key %s is reserved", invalid, what, ReservedMetadata)
		}
		if err := checkText(invalid, what+": key", k); err != nil {
			return err
		}
		if !pgtext.Valid(v) {
			return checkText(invalid, fmt.Sprintf("%s: value of %q", what, k), v)
		}
	}
	return nil
}

// SlotOf returns the slot of a partition key; messages without a key are spread by their UUID.
func SlotOf(partitionKey, uuid string) int16 {
	s := partitionKey
	if s == "" {
		s = uuid
	}
	// 32-bit FNV-1a, as hash/fnv's New32a computes it, written out: through hash.Hash32 the hash
	// and the key's bytes would be allocated for every message.
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return int16(h % Slots)
}

// Publisher returns a Watermill message.Publisher that writes into tx, for code written against
// Watermill's interface. It is valid only as long as tx is; Close does nothing.
func (w *Writer) Publisher(ctx context.Context, tx Execer) message.Publisher {
	return txPublisher{ctx: ctx, w: w, tx: tx}
}

type txPublisher struct {
	ctx context.Context
	w   *Writer
	tx  Execer
}

func (p txPublisher) Publish(topic string, msgs ...*message.Message) error {
	return p.w.Publish(p.ctx, p.tx, topic, msgs...)
}

func (txPublisher) Close() error { return nil }

type sourceKey struct{}

// Source identifies the incoming message a handler is processing, for the idempotency keys of the
// side-effect calls it writes (see IdempotencyKey).
type Source struct {
	// Consumer is the inbox's consumer name.
	Consumer string
	// Handler is the name of the router handler processing the message (Watermill's
	// message.HandlerNameFromCtx), or "" outside a router.
	Handler string
	// DedupKey is the message's dedup key.
	DedupKey string
}

// ContextWithSource records which incoming message is being processed. Side-effect calls written
// under such a context derive their idempotency keys from it, so a redelivery of the message yields
// the same keys. The inbox middleware sets it for handlers, anew for each attempt.
func ContextWithSource(ctx context.Context, s Source) context.Context {
	return context.WithValue(ctx, sourceKey{}, s)
}

// SourceFromContext returns what ContextWithSource recorded.
func SourceFromContext(ctx context.Context) (Source, bool) {
	s, ok := ctx.Value(sourceKey{}).(Source)
	return s, ok
}
