package inbox

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/metrics"
	"github.com/txbox/txbox/internal/pgtext"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/outbox"
)

// ErrUnprocessable marks a handler error as permanent: the message goes to the dead-letter table at
// once instead of being retried. Wrap it: fmt.Errorf("%w: unknown currency %q", inbox.ErrUnprocessable, c).
var ErrUnprocessable = errors.New("inbox: message is unprocessable")

// Reasons recorded with dead letters; stable, for filtering and alerting.
const (
	ReasonNoID              = "no usable id"
	ReasonTooLarge          = "payload too large"
	ReasonUnprocessable     = "unprocessable"
	ReasonAttemptsExhausted = "attempts exhausted"
	ReasonBadMetadata       = "undecodable metadata"
)

// DB is what the inbox needs from PostgreSQL; *pgxpool.Pool satisfies it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Config configures an Inbox.
type Config struct {
	// DB is the database holding the inbox and the handler's business tables. Required.
	DB DB
	// Consumer names the consumer: deduplication is per consumer, so two services reading one topic
	// each process every message once. Required.
	Consumer string
	// Schema is the PostgreSQL schema holding txbox's tables. If not specified, defaults to "public".
	Schema string
	// DedupKey returns the key a message is deduplicated by. If not specified, defaults to the
	// message UUID. An empty key or an error sends the message to the dead-letter table.
	DedupKey func(*message.Message) (string, error)
	// MaxAttempts is how many deliveries a message gets before it is moved to the dead-letter table.
	// Attempts are counted durably, before the handler runs. If not specified, defaults to 10;
	// a negative value disables counting (a failing message is then retried forever).
	MaxAttempts int
	// MaxPayloadBytes sends larger messages to the dead-letter table unprocessed. If not specified,
	// defaults to outbox.DefaultMaxPayloadBytes.
	MaxPayloadBytes int
	// Outbox writes the messages a handler returns. If not specified, one is made for Schema.
	Outbox *outbox.Writer
	// Delivery says where the broker delivered a message from (for Kafka: its partition and
	// offset). The inbox tracks fencing tokens per partition with it (see
	// txbox_superseded_token_messages_total). Kafka consumers set it to kafkasub.Delivery; it is a
	// function rather than a dependency so that importing the inbox pulls in no Kafka client. If
	// not specified, fencing tokens are not tracked.
	Delivery func(ctx context.Context) (partition int32, offset int64, ok bool)
	// Registerer receives the inbox's Prometheus metrics. If not specified, they are not registered.
	Registerer prometheus.Registerer
}

// DefaultMaxAttempts is Config.MaxAttempts when it is not specified.
const DefaultMaxAttempts = 10

// Inbox is the deduplicating middleware. Create it with New; it is safe for concurrent use.
type Inbox struct {
	cfg     Config
	sql     queries
	dead    *dlq.Writer
	logger  watermill.LoggerAdapter
	metrics *metrics.Inbox

	tokensMu sync.Mutex
	tokens   map[stream]int64 // highest fencing token seen per ordered stream
}

type stream struct {
	shard     string
	topic     string
	partition int32
}

// New validates cfg and returns an Inbox. logger may be nil.
func New(cfg Config, logger watermill.LoggerAdapter) (*Inbox, error) {
	if cfg.DB == nil {
		return nil, errors.New("inbox: Config.DB is required")
	}
	if cfg.Consumer == "" {
		return nil, errors.New("inbox: Config.Consumer is required: it names the consumer that deduplication is scoped to")
	}
	schema, err := sqlname.Schema(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("inbox: Config.Schema: %w", err)
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.MaxPayloadBytes < 0 {
		return nil, fmt.Errorf("inbox: Config.MaxPayloadBytes must not be negative, got %d", cfg.MaxPayloadBytes)
	}
	if cfg.MaxPayloadBytes == 0 {
		cfg.MaxPayloadBytes = outbox.DefaultMaxPayloadBytes
	}
	if cfg.DedupKey == nil {
		cfg.DedupKey = func(m *message.Message) (string, error) { return m.UUID, nil }
	}
	if cfg.Outbox == nil {
		if cfg.Outbox, err = outbox.New(outbox.Config{Schema: cfg.Schema}); err != nil {
			return nil, fmt.Errorf("inbox: %w", err)
		}
	}
	dead, err := dlq.NewWriter(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("inbox: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Inbox{
		cfg:     cfg,
		sql:     renderQueries(schema),
		dead:    dead,
		logger:  logger.With(watermill.LogFields{"consumer": cfg.Consumer}),
		metrics: metrics.NewInbox(cfg.Registerer, cfg.Schema),
		tokens:  map[stream]int64{},
	}, nil
}

type txKey struct{}

// TxFromContext returns the transaction the inbox opened for the message whose context ctx is (or
// derives from). Handlers write their business rows and outbox messages through it.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok
}

// Middleware wraps h; add it with router.AddMiddleware or handler.AddMiddleware.
func (ib *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		return nil, ib.handle(msg, h)
	}
}

// handle returns nil when the message must be acknowledged: processed now, processed before, or
// moved to the dead-letter table.
func (ib *Inbox) handle(msg *message.Message, h message.HandlerFunc) error {
	ctx := msg.Context()
	consumer := ib.cfg.Consumer
	ib.metrics.DedupChecks.WithLabelValues(consumer).Inc()

	key, err := ib.cfg.DedupKey(msg)
	switch {
	case err != nil:
	case key == "":
		err = errors.New("empty dedup key")
	case !pgtext.Valid(key) || !pgtext.Valid(msg.UUID):
		// The database refuses such text: the message could be neither recorded nor processed.
		err = errors.New("the message id or dedup key is not valid UTF-8 or contains NUL")
		key = ""
	}
	if err != nil {
		return ib.kill(ctx, msg, "", ReasonNoID, err, 0)
	}
	if len(msg.Payload) > ib.cfg.MaxPayloadBytes {
		return ib.kill(ctx, msg, key, ReasonTooLarge,
			fmt.Errorf("payload of %d bytes is over the %d-byte limit", len(msg.Payload), ib.cfg.MaxPayloadBytes), 0)
	}
	shard, token, err := leaseOf(msg)
	if err != nil {
		return ib.kill(ctx, msg, key, ReasonBadMetadata, err, 0)
	}
	ib.observeToken(ctx, msg, shard, token)

	attempts := 0
	if ib.cfg.MaxAttempts > 0 {
		// Counted in its own transaction, before the handler: a crash inside the handler still counts.
		var lastErr *string
		err := ib.cfg.DB.QueryRow(ctx, ib.sql.countAttempt, consumer, key).Scan(&attempts, &lastErr)
		if errors.Is(err, pgx.ErrNoRows) {
			ib.metrics.DedupHits.WithLabelValues(consumer).Inc()
			return nil // Processed (or dead) before: the inbox row exists.
		}
		if err != nil {
			return fmt.Errorf("inbox: count attempt of %s: %w", key, err)
		}
		if attempts > ib.cfg.MaxAttempts {
			cause := fmt.Errorf("%d attempts failed", attempts-1)
			if lastErr != nil {
				cause = fmt.Errorf("%d attempts failed, last: %s", attempts-1, *lastErr)
			}
			return ib.kill(ctx, msg, key, ReasonAttemptsExhausted, cause, attempts-1)
		}
	}

	processed, herr := ib.process(ctx, msg, h, key, shard, token)
	switch {
	case herr == nil && !processed:
		ib.metrics.DedupHits.WithLabelValues(consumer).Inc()
		ib.forgetAttempts(ctx, key)
		return nil
	case herr == nil:
		ib.metrics.Attempts.WithLabelValues(consumer).Observe(float64(max(attempts, 1)))
		return nil
	case errors.Is(herr, ErrUnprocessable):
		return ib.kill(ctx, msg, key, ReasonUnprocessable, herr, attempts)
	}
	if ib.cfg.MaxAttempts > 0 {
		if _, err := ib.cfg.DB.Exec(ctx, ib.sql.recordError, consumer, key, herr.Error()); err != nil {
			ib.logger.Error("Could not record the handler error", err, watermill.LogFields{"dedup_key": key})
		}
	}
	return herr
}

// process runs h in a transaction with the inbox row. processed is false when the row existed.
func (ib *Inbox) process(ctx context.Context, msg *message.Message, h message.HandlerFunc, key string, shard *int32, token *int64) (processed bool, err error) {
	tx, err := ib.cfg.DB.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("inbox: begin: %w", err)
	}
	defer func() {
		if !processed || err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	tag, err := tx.Exec(ctx, ib.sql.insertInbox, ib.cfg.Consumer, key, msg.UUID, message.SubscribeTopicFromCtx(ctx), shard, token)
	if err != nil {
		return false, fmt.Errorf("inbox: insert %s: %w", key, err)
	}
	failpoint.HitContext(ctx, "inbox.after-insert")
	if tag.RowsAffected() == 0 {
		return false, nil
	}

	orig := msg.Context()
	msg.SetContext(outbox.ContextWithSource(context.WithValue(orig, txKey{}, tx), ib.cfg.Consumer, key))
	produced, err := h(msg)
	msg.SetContext(orig)
	failpoint.HitContext(ctx, "inbox.after-handler")
	if err != nil {
		return false, err
	}
	if len(produced) > 0 {
		topic := message.PublishTopicFromCtx(ctx)
		if topic == "" {
			return false, fmt.Errorf("inbox: the handler returned %d message(s) but has no publish topic; write them with the outbox instead", len(produced))
		}
		if err := ib.cfg.Outbox.Publish(ctx, tx, topic, produced...); err != nil {
			return false, err
		}
	}
	if ib.cfg.MaxAttempts > 0 {
		if _, err := tx.Exec(ctx, ib.sql.deleteAttempts, ib.cfg.Consumer, key); err != nil {
			return false, fmt.Errorf("inbox: clear attempts of %s: %w", key, err)
		}
	}
	failpoint.HitContext(ctx, "inbox.before-commit")
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("inbox: commit %s: %w", key, err)
	}
	failpoint.HitContext(ctx, "inbox.after-commit")
	return true, nil
}

// kill moves msg to the dead-letter table and marks it dead in the inbox, in one transaction, so a
// redelivery is skipped. A nil return acknowledges the message.
func (ib *Inbox) kill(ctx context.Context, msg *message.Message, key, reason string, cause error, attempts int) error {
	uuid := msg.UUID
	if key == "" {
		// No id of its own: the broker's UUID still names it, so a redelivery is recognised. An id
		// the database cannot store as text is stored in hex.
		key = "uuid:" + uuid
		if !pgtext.Valid(uuid) {
			key = "uuid-hex:" + hex.EncodeToString([]byte(uuid))
			uuid = pgtext.Sanitize(uuid)
		}
	}
	tx, err := ib.cfg.DB.Begin(ctx)
	if err != nil {
		return fmt.Errorf("inbox: begin dead letter: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // A no-op after Commit.

	tag, err := tx.Exec(ctx, ib.sql.insertDead, ib.cfg.Consumer, key, uuid, message.SubscribeTopicFromCtx(ctx))
	if err != nil {
		return fmt.Errorf("inbox: mark %s dead: %w", key, err)
	}
	if tag.RowsAffected() == 0 {
		ib.metrics.DedupHits.WithLabelValues(ib.cfg.Consumer).Inc()
		return nil // Another delivery settled it first.
	}
	err = ib.dead.Add(ctx, tx, dlq.Entry{
		Source:       dlq.SourceInbox,
		Topic:        message.SubscribeTopicFromCtx(ctx),
		Consumer:     ib.cfg.Consumer,
		DedupKey:     key,
		PartitionKey: msg.Metadata.Get(outbox.PartitionKeyMetadata),
		UUID:         uuid,
		Payload:      msg.Payload,
		Metadata:     msg.Metadata,
		Reason:       reason,
		Error:        cause.Error(),
		Attempts:     attempts,
	})
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, ib.sql.deleteAttempts, ib.cfg.Consumer, key); err != nil {
		return fmt.Errorf("inbox: clear attempts of %s: %w", key, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("inbox: commit dead letter %s: %w", key, err)
	}
	ib.metrics.DeadLetters.WithLabelValues(string(dlq.SourceInbox), reason).Inc()
	ib.logger.Info("Message moved to the dead-letter table", watermill.LogFields{
		"message_uuid": uuid, "dedup_key": key, "reason": reason, "error": cause.Error(),
	})
	return nil
}

// forgetAttempts removes the attempt counter a duplicate delivery created while the first delivery
// was still in flight; leaving it would only cost a row.
func (ib *Inbox) forgetAttempts(ctx context.Context, key string) {
	if ib.cfg.MaxAttempts <= 0 {
		return
	}
	if _, err := ib.cfg.DB.Exec(ctx, ib.sql.deleteAttempts, ib.cfg.Consumer, key); err != nil {
		ib.logger.Debug("Could not clear attempts of a duplicate", watermill.LogFields{"dedup_key": key, "error": err.Error()})
	}
}

// leaseOf reads the relay lease a message was published under; messages that did not come through
// the relay have none.
func leaseOf(msg *message.Message) (*int32, *int64, error) {
	s, t := msg.Metadata.Get(outbox.ShardMetadata), msg.Metadata.Get(outbox.TokenMetadata)
	if s == "" && t == "" {
		return nil, nil, nil
	}
	shard, err := strconv.ParseInt(s, 10, 32)
	if err != nil {
		return nil, nil, fmt.Errorf("metadata %s=%q: %w", outbox.ShardMetadata, s, err)
	}
	token, err := strconv.ParseInt(t, 10, 64)
	if err != nil {
		return nil, nil, fmt.Errorf("metadata %s=%q: %w", outbox.TokenMetadata, t, err)
	}
	s32 := int32(shard)
	return &s32, &token, nil
}

// observeToken counts messages that carry an older fencing token than one already seen on the same
// ordered stream (shard, topic, partition). Across partitions an older token can arrive later
// legitimately, so the stream, not the shard, is the unit.
func (ib *Inbox) observeToken(ctx context.Context, msg *message.Message, shard *int32, token *int64) {
	if shard == nil || ib.cfg.Delivery == nil {
		return
	}
	partition, _, ok := ib.cfg.Delivery(ctx)
	if !ok {
		return
	}
	key := stream{shard: strconv.Itoa(int(*shard)), topic: message.SubscribeTopicFromCtx(ctx), partition: partition}
	ib.tokensMu.Lock()
	defer ib.tokensMu.Unlock()
	if seen, ok := ib.tokens[key]; ok && *token < seen {
		ib.metrics.SupersededTokens.WithLabelValues(ib.cfg.Consumer).Inc()
		return
	}
	ib.tokens[key] = *token
}
