package inbox

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

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

// DB is what the inbox needs from PostgreSQL; *pgxpool.Pool and *pgx.Conn satisfy it. The inbox
// begins transactions with a batch (pgx's Batch.BeginTx), so that BEGIN costs no round trip.
type DB interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Config configures an Inbox.
type Config struct {
	// DB is the database holding the inbox and the handler's business tables. Required.
	DB DB
	// Consumer names the consumer. Deduplication is per consumer and per handler: a message is
	// processed once by each router handler the inbox wraps (message.HandlerNameFromCtx), so two
	// services, or two handlers of one router, reading one topic each process every message once.
	// Outside a router (no handler name) the scope is the consumer alone. Required.
	Consumer string
	// Schema is the PostgreSQL schema holding txbox's tables. If not specified, defaults to "public".
	Schema string
	// DedupKey returns the key a message is deduplicated by, within its consumer and handler. If
	// not specified, defaults to the message UUID. An empty key or an error sends the message to
	// the dead-letter table.
	DedupKey func(*message.Message) (string, error)
	// MaxAttempts is how many deliveries a message gets before it is moved to the dead-letter table.
	// A crash of the process counts against the message only if it ran alone, as a crash suspect
	// (see the package doc). If not specified, defaults to 10;
	// a negative value disables counting (a failing message is then retried forever).
	MaxAttempts int
	// MaxPayloadBytes sends larger messages to the dead-letter table unprocessed. If not specified,
	// defaults to outbox.DefaultMaxPayloadBytes.
	MaxPayloadBytes int
	// Outbox writes the messages a handler returns. If not specified, one is made for Schema.
	Outbox *outbox.Writer
	// Delivery says where the broker delivered a message from (for Kafka: its partition and
	// offset). The inbox tracks fencing tokens per partition with it (see
	// txbox_superseded_token_messages_total), and names a message without a usable id by its
	// topic, partition and offset, so that each such record gets one dead letter. Kafka consumers
	// set it to kafkasub.Delivery; it is a function rather than a dependency so that importing the
	// inbox pulls in no Kafka client. If not specified, fencing tokens are not tracked and a
	// message without a usable id is named by a hash of its content.
	Delivery func(ctx context.Context) (partition int32, offset int64, ok bool)
	// LockTimeout bounds how long a delivery waits for a lock that another delivery of the same
	// message holds (a second consumer instance still processing it, or one frozen in its
	// handler): after it the delivery fails with PostgreSQL's lock_not_available and is retried
	// like any error, without using up an attempt. Under a deadline on the delivery's context (a
	// Timeout middleware), a wait is also bounded by three quarters of the time left when the
	// handler's transaction begins, so that it ends as a lock timeout rather than be cut off by the
	// deadline, which counts as an attempt. If not specified, defaults to DefaultLockTimeout; a
	// negative value waits without limit.
	LockTimeout time.Duration
	// IdleInTransactionTimeout bounds how long the handler's transaction may sit idle, no
	// statement running, before PostgreSQL ends its session and so releases its locks: a consumer
	// frozen in its handler (a stopped process, a long GC or VM pause, a handler blocked on
	// something else) holds the message's inbox row at most this long. Its late commit then fails
	// and another delivery processes the message once. Keep it above the longest pause a healthy
	// handler makes between statements. If not specified, defaults to
	// DefaultIdleInTransactionTimeout; a negative value disables it.
	IdleInTransactionTimeout time.Duration
	// StatsInterval is how often, at most, the dedup checks and hits counted in memory are added
	// to txbox_dedup_stats (per consumer, handler and minute), where `txbox status` reads the hit
	// rate. They are written in the background by a statement of their own once the interval has
	// passed, also when no message comes after them, so a message never waits for them; call Flush
	// when the router stops to write the rest. If not specified, defaults to DefaultStatsInterval;
	// a negative value disables the writes.
	StatsInterval time.Duration
	// Registerer receives the inbox's Prometheus metrics. If not specified, they are not registered.
	Registerer prometheus.Registerer
	// TracerProvider makes a consumer span per delivery, continuing the trace in the message's
	// metadata (through the global OpenTelemetry propagator; the relay puts its publish span
	// there). The handler's context carries the span, so the outbox stores it with what the
	// handler writes. If not specified, the global TracerProvider.
	TracerProvider trace.TracerProvider
}

// MaxDedupKeyBytes is the longest dedup key the inbox takes (by default a message's UUID, for which
// the outbox has the same limit): its rows are keyed by it in a B-tree index. A message with a
// longer key goes to the dead-letter table with ReasonNoID.
const MaxDedupKeyBytes = outbox.MaxUUIDBytes

// MaxNameBytes is the longest consumer name (Config.Consumer) and router handler name the inbox
// takes: they share the index entries of a message's rows with its dedup key, which PostgreSQL
// bounds at 2,704 bytes. A delivery to a handler of a longer name fails, naming it; its message
// stays unacknowledged until the handler is renamed.
const MaxNameBytes = 256

// Defaults of Config.
const (
	DefaultMaxAttempts              = 10
	DefaultLockTimeout              = 2 * time.Second
	DefaultIdleInTransactionTimeout = 30 * time.Second
)

// maxTimeout is the longest timeout PostgreSQL accepts (INT_MAX milliseconds).
const maxTimeout = math.MaxInt32 * time.Millisecond

// Inbox is the deduplicating middleware. Create it with New; it is safe for concurrent use.
type Inbox struct {
	cfg     Config
	sql     queries
	bounds  [2]string // lock_timeout and idle_in_transaction_session_timeout, in milliseconds
	dead    *dlq.Writer
	logger  watermill.LoggerAdapter
	metrics *metrics.Inbox
	stats   statsBuffer
	tracer  trace.Tracer

	tokensMu sync.Mutex
	tokens   map[stream]int64 // highest fencing token seen per ordered stream

	// duplicates says that the last delivery counted was a duplicate (see handle).
	duplicates atomic.Bool

	endsFailing streak // of endAttempt's writes

	// lostEnds are the transient ends of attempts that endAttempt could not write, by scope, each
	// saying whether its attempt ran alone. A PostgreSQL restart while a message is in its handler
	// fails the handler and then, the server still being down, the write of its end: left
	// unwritten, the attempt would make the message a crash suspect, and restarts that cut off its
	// runs alone would count as crashes, dead-lettering a healthy message. The next delivery of the
	// message writes them before its marker (writeLostEnds).
	lostEndsMu sync.Mutex
	lostEnds   map[scope][]bool

	// crashDomain makes a crash attributable: a crash suspect runs while no other message of the
	// inbox does (it takes it exclusively, every other delivery shared), so if the process dies
	// then, the suspect killed it.
	crashDomain sync.RWMutex
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
	if !pgtext.Valid(cfg.Consumer) {
		return nil, fmt.Errorf("inbox: Config.Consumer %q is not valid UTF-8 or contains NUL: the database cannot store it", cfg.Consumer)
	}
	if len(cfg.Consumer) > MaxNameBytes {
		return nil, fmt.Errorf("inbox: Config.Consumer of %d bytes is over the %d-byte limit (inbox.MaxNameBytes)", len(cfg.Consumer), MaxNameBytes)
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
	var timeouts [2]string
	for i, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"LockTimeout", &cfg.LockTimeout, DefaultLockTimeout},
		{"IdleInTransactionTimeout", &cfg.IdleInTransactionTimeout, DefaultIdleInTransactionTimeout},
	} {
		switch {
		case *d.v == 0:
			*d.v = d.def
		case *d.v > 0 && *d.v < time.Millisecond, *d.v > maxTimeout:
			return nil, fmt.Errorf("inbox: Config.%s must be between 1ms and %s (or negative for no limit), got %s", d.name, maxTimeout, *d.v)
		}
		timeouts[i] = strconv.FormatInt(max(d.v.Milliseconds(), 0), 10) // 0 is PostgreSQL's "no limit"
	}
	switch {
	case cfg.StatsInterval == 0:
		cfg.StatsInterval = DefaultStatsInterval
	case cfg.StatsInterval < 0:
		cfg.StatsInterval = 0
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
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = otel.GetTracerProvider()
	}
	sql := renderQueries(schema)
	return &Inbox{
		cfg:     cfg,
		sql:     sql,
		bounds:  timeouts,
		dead:    dead,
		logger:  logger.With(watermill.LogFields{"consumer": cfg.Consumer}),
		metrics: metrics.NewInbox(cfg.Registerer, cfg.Schema),
		stats:   statsBuffer{interval: cfg.StatsInterval, pending: map[string]dedupCounts{}, flushSQL: sql.flushStats},
		tracer:  cfg.TracerProvider.Tracer(tracerName),
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

// scope is what a message is deduplicated by: its consumer, the router handler processing it ("" outside
// a router) and its dedup key.
type scope struct {
	consumer, handler, key string
}

// args are the parameters of a statement run under ctx: the scope ($1 consumer, $2 dedup key, $3
// handler), the bounds ($4, $5), then more from $6 (see sql.go).
func (ib *Inbox) args(ctx context.Context, s scope, more ...any) []any {
	return append([]any{s.consumer, s.key, s.handler, ib.lockTimeout(ctx), ib.bounds[1]}, more...)
}

// lockTimeout is the lock_timeout, in milliseconds, of statements run under ctx, and of the rest
// of their transaction. A lock wait that the delivery's deadline (a Timeout middleware's) cuts off
// would count as a slow attempt (isTransient), though whoever held the lock was slow, not the
// message: under a deadline, lock waits are bounded by three quarters of the time left, so that a
// wait that begins early in the transaction ends as a lock timeout, which gives the attempt back.
func (ib *Inbox) lockTimeout(ctx context.Context) string {
	deadline, ok := ctx.Deadline()
	if !ok {
		return ib.bounds[0]
	}
	// 0 would be PostgreSQL's "no limit"; above maxTimeout it refuses the setting, and with it
	// every delivery of a far deadline. Divided first: a deadline a century away times 3
	// overflows.
	wait := min(max(time.Until(deadline)/4*3, time.Millisecond), maxTimeout)
	if ib.cfg.LockTimeout > 0 {
		wait = min(wait, ib.cfg.LockTimeout)
	}
	return strconv.FormatInt(wait.Milliseconds(), 10)
}

// handle returns nil when the message must be acknowledged: processed now, processed before, or
// moved to the dead-letter table.
func (ib *Inbox) handle(msg *message.Message, h message.HandlerFunc) (err error) {
	consumer := ib.cfg.Consumer
	sc := scope{consumer: consumer, handler: message.HandlerNameFromCtx(msg.Context())}
	if len(sc.handler) > MaxNameBytes {
		// Not the message's fault, nor can it be recorded, even as a dead letter.
		return fmt.Errorf("inbox: the router handler's name is %d bytes, over the %d-byte limit (inbox.MaxNameBytes); rename the handler",
			len(sc.handler), MaxNameBytes)
	}
	ib.metrics.DedupChecks.WithLabelValues(consumer, sc.handler).Inc()
	ib.stats.add(sc.handler, 1, 0)
	defer ib.maybeFlush(false)

	orig := msg.Context()
	ctx, span := ib.startSpan(msg, sc)
	msg.SetContext(ctx)
	defer func() {
		msg.SetContext(orig)
		endSpan(span, err)
	}()

	key, err := ib.cfg.DedupKey(msg)
	switch {
	case err != nil:
	case key == "":
		err = errors.New("empty dedup key")
	case !pgtext.Valid(key) || !pgtext.Valid(msg.UUID):
		// The database refuses such text: the message could be neither recorded nor processed.
		err = errors.New("the message id or dedup key is not valid UTF-8 or contains NUL")
		key = ""
	case len(key) > MaxDedupKeyBytes:
		// Nor does the inbox's index take such a key: every delivery failed, holding up its
		// partition for ever.
		err = fmt.Errorf("dedup key of %d bytes is over the %d-byte limit", len(key), MaxDedupKeyBytes)
		key = ""
	}
	if err != nil {
		return ib.kill(ctx, msg, sc, ReasonNoID, err, 0)
	}
	sc.key = key
	span.SetAttributes(attrDedupKey.String(key))
	if len(msg.Payload) > ib.cfg.MaxPayloadBytes {
		return ib.kill(ctx, msg, sc, ReasonTooLarge,
			fmt.Errorf("payload of %d bytes is over the %d-byte limit", len(msg.Payload), ib.cfg.MaxPayloadBytes), 0)
	}
	shard, token, err := leaseOf(msg)
	if err != nil {
		return ib.kill(ctx, msg, sc, ReasonBadMetadata, err, 0)
	}
	ib.observeToken(ctx, msg, shard, token)

	attempts, alone := 0, false
	var (
		tx   pgx.Tx
		herr error
	)
	if ib.cfg.MaxAttempts > 0 {
		if err := ib.writeLostEnds(ctx, sc); err != nil {
			return fmt.Errorf("inbox: record the end of an earlier attempt of %s: %w", key, err)
		}
		// The crash marker is written before the handler runs: a crash inside the handler leaves it.
		// It goes in the round trip that opens the handler's transaction, before it, so a fresh
		// message pays no round trip for it; a delivery holds the crash domain shared from then on,
		// so none starts while a suspect runs alone.
		if !ib.crashDomain.TryRLock() {
			failpoint.HitContext(ctx, "inbox.waits-for-suspect") // A suspect runs alone, or is about to.
			ib.crashDomain.RLock()
		}
		mark := marker{args: ib.args(ctx, sc)}
		// The round trip that writes the marker is not cut short when the delivery is cancelled
		// (the router stopping): the server may have committed the marker before the answer came,
		// and a marker that is never ended makes the message a crash suspect. Its statements bound
		// their own waits; the cancelled delivery then fails in the handler as transient, and gives
		// its attempt back.
		marking, cancel := outliving(ctx, settleTimeout)
		defer cancel()
		if ib.duplicates.Load() {
			// Redeliveries come in runs (a consumer restarted, a group reset): this one is most
			// likely a duplicate too, which the marker alone answers in one round trip, where the
			// transaction opened with it would cost a second one to end.
			herr = ib.count(marking, &mark)
			if herr == nil && !mark.settled && !mark.suspect && mark.attempts < ib.cfg.MaxAttempts {
				tx, herr = ib.open(ctx, msg, sc, shard, token, nil)
			}
		} else {
			tx, herr = ib.open(marking, msg, sc, shard, token, &mark)
		}
		ib.duplicates.Store(mark.settled || errors.Is(herr, errTaken))
		if !mark.committed {
			ib.crashDomain.RUnlock()
			return fmt.Errorf("inbox: count attempt of %s: %w", key, herr)
		}
		attempts = mark.attempts
		switch {
		case mark.settled:
			// Processed (or dead) before: the inbox row exists, and open found it too, unless
			// retention dropped its generation in between.
			rollback(ctx, tx)
			ib.crashDomain.RUnlock()
			ib.hit(ctx, sc)
			return nil
		case errors.Is(herr, errTaken):
			defer ib.crashDomain.RUnlock() // Settled while this delivery waited for it: see below.
		case mark.suspect:
			// The transaction opened for the handler holds the message's rows, which running alone
			// writes: it ends first.
			rollback(ctx, tx)
			ib.crashDomain.RUnlock()
			// Nor is this delivery in flight while it waits to run alone: its marker goes, so that a
			// crash meanwhile (another suspect's, running alone) is not charged to it, nor a
			// failure to start running alone.
			ib.endAttempt(ctx, sc, false, true, nil)
			failpoint.HitContext(ctx, "inbox.before-run-alone")
			ib.crashDomain.Lock()
			defer ib.crashDomain.Unlock()
			err := ib.cfg.DB.QueryRow(ctx, ib.sql.runAlone, ib.args(ctx, sc, ib.cfg.MaxAttempts)...).Scan(&attempts, &mark.lastErr, &alone)
			switch {
			case errors.Is(err, pgx.ErrNoRows):
				// The counter is gone: another delivery settled the message meanwhile, which the
				// inbox row will show.
				alone = true
			case err != nil:
				return fmt.Errorf("inbox: run %s alone: %w", key, err)
			case !alone:
				// Nothing to give back: the statement ended the attempt it would have started.
				return ib.exhausted(ctx, msg, sc, attempts, mark.lastErr)
			}
			tx, herr = ib.open(ctx, msg, sc, shard, token, nil)
		case attempts >= ib.cfg.MaxAttempts:
			rollback(ctx, tx) // It holds the message's inbox row, which the dead letter's writes.
			ib.crashDomain.RUnlock()
			err := ib.exhausted(ctx, msg, sc, attempts, mark.lastErr)
			if err != nil {
				ib.endAttempt(ctx, sc, false, true, err) // This delivery did nothing.
			}
			return err
		default:
			attempts++ // This one.
			defer ib.crashDomain.RUnlock()
		}
	} else {
		tx, herr = ib.open(ctx, msg, sc, shard, token, nil)
	}
	if errors.Is(herr, errTaken) {
		ib.hit(ctx, sc)
		ib.forgetAttempts(ctx, sc)
		return nil
	}
	transient := true // The handler never ran.
	if herr == nil {
		failpoint.HitContext(ctx, "inbox.after-insert")
		transient, herr = ib.process(ctx, msg, h, sc, tx)
	}
	switch {
	case herr == nil:
		ib.metrics.Attempts.WithLabelValues(consumer, sc.handler).Observe(float64(max(attempts, 1)))
		span.AddEvent(eventProcessed, trace.WithAttributes(attrAttempt.Int(max(attempts, 1))))
		return nil
	case errors.Is(herr, ErrUnprocessable):
		return ib.kill(ctx, msg, sc, ReasonUnprocessable, herr, attempts)
	}
	if ib.cfg.MaxAttempts > 0 {
		ib.endAttempt(ctx, sc, alone, transient, herr)
	}
	return herr
}

// exhausted moves a message whose failed attempts reached the limit to the dead-letter table.
func (ib *Inbox) exhausted(ctx context.Context, msg *message.Message, sc scope, attempts int, lastErr *string) error {
	cause := fmt.Errorf("%d attempts failed", attempts)
	if lastErr != nil {
		cause = fmt.Errorf("%d attempts failed, last: %s", attempts, *lastErr)
	}
	return ib.kill(ctx, msg, sc, ReasonAttemptsExhausted, cause, attempts)
}

// hit counts a delivery recognised as a duplicate, and marks its span.
func (ib *Inbox) hit(ctx context.Context, sc scope) {
	ib.metrics.DedupHits.WithLabelValues(sc.consumer, sc.handler).Inc()
	ib.stats.add(sc.handler, 0, 1)
	trace.SpanFromContext(ctx).AddEvent(eventDuplicate)
}

// settleTimeout bounds the bookkeeping after a delivery failed, which runs even when the delivery's
// context was cancelled.
const settleTimeout = 5 * time.Second

// outliving returns a context with ctx's values that ends grace after ctx is cancelled, for work
// that must not stop halfway when the router stops. It keeps ctx's deadline: the delivery's own
// limit still holds.
func outliving(ctx context.Context, grace time.Duration) (context.Context, context.CancelFunc) {
	base, endDeadline := context.WithoutCancel(ctx), context.CancelFunc(func() {})
	if deadline, ok := ctx.Deadline(); ok {
		base, endDeadline = context.WithDeadline(base, deadline)
	}
	out, cancel := context.WithCancel(base)
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(grace, cancel) })
	return out, func() {
		stop()
		cancel()
		endDeadline()
	}
}

// endAttempt records how a counted delivery failed (alone: it ran as a crash suspect). A failure of
// the message (the handler's error, or a crash, which never gets here) keeps its attempt and becomes
// the last error. A transient one gives the attempt back, so that only real failures bring a message
// to the dead-letter table. If the database cannot be reached for this either, a transient end is
// kept for the message's next delivery in this process to write (lostEnds); a failure's attempt
// stays unfinished, and the message is a crash suspect at its next delivery, which runs it alone
// and counts that run. (A failure's end is not kept: its write may have committed though its answer
// was lost, and written twice it would charge the failure twice. A transient end written twice
// gives back one attempt too many, at most once per lost answer.)
func (ib *Inbox) endAttempt(ctx context.Context, sc scope, alone, transient bool, cause error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	var lastErr any // A transient failure keeps the last error the message's own failure left.
	if !transient {
		lastErr = cause.Error()
	}
	_, err := ib.cfg.DB.Exec(ctx, ib.sql.endAttempt, ib.args(ctx, sc, alone, transient, lastErr)...)
	kept := err != nil && transient && ib.keepLostEnds(sc, alone)
	fields := sc.logFields()
	fields["transient"] = transient
	switch first, recovered := ib.endsFailing.report(err); {
	case first && kept:
		ib.logger.Error("Could not record the end of an attempt; the message's next delivery records it first (logged once until such a record succeeds again)", err, fields)
	case first:
		ib.logger.Error("Could not record the end of an attempt; the message is a crash suspect at its next delivery (logged once until such a record succeeds again)", err, fields)
	case err != nil:
		ib.logger.Debug("Could not record the end of an attempt", fields.Add(watermill.LogFields{"error": err}))
	case recovered:
		ib.logger.Info("Recording the ends of attempts again", nil)
	}
}

// maxLostEnds bounds the scopes whose lost ends an Inbox keeps: in a long outage, with a subscriber
// that delivers many messages at once, their messages may never come back to this process. One past
// the bound is a crash suspect at its next delivery, as if the process had crashed.
const maxLostEnds = 10000

// keepLostEnds keeps the transient ends of sc's attempts that could not be written, each saying
// whether its attempt ran alone, and reports whether they are kept.
func (ib *Inbox) keepLostEnds(sc scope, alone ...bool) bool {
	ib.lostEndsMu.Lock()
	defer ib.lostEndsMu.Unlock()
	if ib.lostEnds == nil {
		ib.lostEnds = make(map[scope][]bool)
	}
	ends, ok := ib.lostEnds[sc]
	if !ok && len(ib.lostEnds) >= maxLostEnds {
		return false
	}
	ib.lostEnds[sc] = append(ends, alone...)
	return true
}

// writeLostEnds writes the ends of sc's earlier attempts that endAttempt could not, before the
// marker of a new attempt makes the message look like a crash suspect. Those it cannot write either
// are kept for the next delivery.
func (ib *Inbox) writeLostEnds(ctx context.Context, sc scope) error {
	ib.lostEndsMu.Lock()
	ends := ib.lostEnds[sc]
	delete(ib.lostEnds, sc)
	ib.lostEndsMu.Unlock()
	for i, alone := range ends {
		if _, err := ib.cfg.DB.Exec(ctx, ib.sql.endAttempt, ib.args(ctx, sc, alone, true, nil)...); err != nil {
			ib.keepLostEnds(sc, ends[i:]...)
			return err
		}
	}
	return nil
}

// streak tells a failing operation's first failure and its first success after failures apart from
// the others, so that it is logged once when it starts failing and once when it recovers: in a
// database outage every delivery's bookkeeping fails.
type streak struct{ failing atomic.Bool }

// report records how the operation ended and says whether that began or ended a failing streak.
func (s *streak) report(err error) (first, recovered bool) {
	was := s.failing.Swap(err != nil)
	return err != nil && !was, err == nil && was
}

// isTransient reports whether err, which ended a delivery after its handler was called, is about the
// database or the process rather than the message, so that a later delivery may well succeed:
// the delivery was cancelled (shutdown), or PostgreSQL reported a serialization failure, a
// deadlock, a lock timeout, a lost connection or a server shutting down, or the outbox found the
// schema lacking a migration (new handlers deployed before txbox migrate up ran: every message
// would fail alike until it runs). The transaction's connection being closed covers connection
// losses that reach the handler as other errors.
//
// An idle-in-transaction timeout (25P03) and a deadline that ran out are not transient: a handler
// that freezes or is too slow on a message every time must bring it to the dead-letter table, like
// one that crashes.
func isTransient(ctx context.Context, tx pgx.Tx, err error) bool {
	var pgErr *pgconn.PgError
	isPg := errors.As(err, &pgErr)
	switch {
	case isPg && pgErr.Code == "25P03": // idle_in_transaction_session_timeout; the connection is closed too
		return false
	case errors.Is(err, outbox.ErrSchemaOutdated):
		return true
	case errors.Is(ctx.Err(), context.Canceled):
		return true
	case errors.Is(err, context.DeadlineExceeded), errors.Is(ctx.Err(), context.DeadlineExceeded):
		// The delivery's deadline (a Timeout middleware) or the handler's own ran out: slow on
		// this message, maybe every time, like a handler that freezes. pgx closes the connection
		// of a statement a deadline cuts off, which must not pass for a lost connection below: the
		// message was retried for ever, its attempts given back each time.
		return false
	case tx.Conn().IsClosed():
		return true
	case !isPg:
		return false
	}
	switch pgErr.Code {
	case "40001", // serialization_failure
		"40P01", // deadlock_detected
		"55P03", // lock_not_available
		"53300", // too_many_connections
		"57P01", // admin_shutdown
		"57P02", // crash_shutdown
		"57P03": // cannot_connect_now
		return true
	}
	return strings.HasPrefix(pgErr.Code, "08") // connection_exception
}

func (s scope) logFields() watermill.LogFields {
	return watermill.LogFields{"handler": s.handler, "dedup_key": s.key}
}

// open begins the handler's transaction with the message's inbox row in it (see beginWithRow),
// writing mark first when it is not nil. Its error is errTaken when the message is settled.
func (ib *Inbox) open(ctx context.Context, msg *message.Message, sc scope, shard *int32, token *int64, mark *marker) (pgx.Tx, error) {
	failpoint.HitContext(ctx, "inbox.before-begin")
	tx, tag, err := ib.beginWithRow(ctx, ib.sql.insertInbox, ib.args(ctx, sc, msg.UUID, message.SubscribeTopicFromCtx(ctx), shard, token), mark)
	switch {
	case err != nil && mark != nil && !mark.committed:
		return nil, err // The marker's: the caller says so.
	case err == nil && tag.RowsAffected() == 0:
		rollback(ctx, tx)
		err = errTaken
	}
	if err != nil {
		return nil, fmt.Errorf("inbox: insert %s: %w", sc.key, err)
	}
	return tx, nil
}

// errTaken is open's error when the message is settled: processed or dead-lettered, maybe by another
// delivery while this one started.
var errTaken = errors.New("the message is settled")

// marker is a delivery's crash marker (countAttemptSQL): its arguments, and its answer once committed.
type marker struct {
	args      []any
	committed bool
	settled   bool // The message has an inbox row: no marker was written.
	attempts  int
	lastErr   *string
	suspect   bool
}

// read takes the marker's answer from row.
func (m *marker) read(row pgx.Row) error {
	err := row.Scan(&m.attempts, &m.lastErr, &m.suspect)
	if m.settled = errors.Is(err, pgx.ErrNoRows); m.settled {
		return nil
	}
	return err
}

// count writes mark in a round trip of its own.
func (ib *Inbox) count(ctx context.Context, mark *marker) error {
	err := mark.read(ib.cfg.DB.QueryRow(ctx, ib.sql.countAttempt, mark.args...))
	mark.committed = err == nil
	return err
}

// beginWithRow begins a transaction and runs insert, the statement that inserts the message's inbox
// row, as its first, after the generation lock (lockGenerationSQL): all three in one round trip
// (pgx's Batch.BeginTx), each a statement of its own, so that the insert's snapshot is taken once
// the lock is held. While a rotation has the lock, it waits for the rotation to end (awaitRotation)
// and begins again. On error, the transaction is over.
//
// A crash marker, when mark is not nil, goes first in the same round trip, in a transaction of its
// own that commits before the other begins: the server runs them one after the other, so the
// marker is committed before the inbox row's statements run, and before the handler can.
func (ib *Inbox) beginWithRow(ctx context.Context, insert string, args []any, mark *marker) (pgx.Tx, pgconn.CommandTag, error) {
	for {
		tx, tag, err := ib.tryBeginWithRow(ctx, insert, args, mark)
		if !errors.Is(err, errRotating) {
			return tx, tag, err
		}
		mark = nil // Committed: the attempt is counted once.
		if err := ib.awaitRotation(ctx, args[3]); err != nil {
			return nil, tag, err
		}
	}
}

// errRotating is tryBeginWithRow's answer when the generation lock is taken.
var errRotating = errors.New("a rotation of the inbox's generations has the generation lock")

func (ib *Inbox) tryBeginWithRow(ctx context.Context, insert string, args []any, mark *marker) (pgx.Tx, pgconn.CommandTag, error) {
	batch := &pgx.Batch{}
	batch.BeginTx(pgx.TxOptions{})
	if mark != nil {
		batch.Queue(ib.sql.countAttempt, mark.args...)
		batch.Queue("commit")
		batch.Queue("begin")
	}
	lock := len(batch.QueuedQueries)
	batch.Queue(ib.sql.lockGeneration)
	batch.Queue(insert, args...)
	results := ib.cfg.DB.SendBatch(ctx, batch)
	tx := results.Tx()
	var (
		tag pgconn.CommandTag
		err error
	)
	for i := range batch.QueuedQueries {
		switch {
		case mark == nil || i > 2:
			tag, err = results.Exec()
		case i == 1:
			err = mark.read(results.QueryRow())
		default: // The begin of either transaction, or the marker's commit.
			_, err = results.Exec()
			mark.committed = err == nil && i == 2
		}
		if err != nil {
			if pgErr := (*pgconn.PgError)(nil); i == lock && errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
				err = fmt.Errorf("%w: %w", errRotating, err)
			}
			break
		}
	}
	if cerr := results.Close(); err == nil {
		err = cerr // Otherwise Close reports the same error again.
	}
	switch {
	case tx == nil:
		return nil, tag, errors.Join(err, errors.New("Config.DB's SendBatch does not begin the transaction of a pgx.Batch.BeginTx"))
	case err != nil:
		rollback(ctx, tx)
		return nil, tag, err
	}
	return tx, tag, nil
}

// awaitRotation waits, at most lockTimeout, until the rotation that has the generation lock ends:
// in a transaction that takes the lock and nothing else, so that the lock's wait has its bound.
func (ib *Inbox) awaitRotation(ctx context.Context, lockTimeout any) error {
	batch := &pgx.Batch{}
	batch.BeginTx(pgx.TxOptions{})
	batch.Queue(lockTimeoutSQL, lockTimeout)
	batch.Queue(ib.sql.awaitGeneration)
	results := ib.cfg.DB.SendBatch(ctx, batch)
	var err error
	for range batch.QueuedQueries {
		if _, err = results.Exec(); err != nil {
			break
		}
	}
	if cerr := results.Close(); err == nil {
		err = cerr
	}
	rollback(ctx, results.Tx())
	if err != nil {
		return fmt.Errorf("wait for the generation lock: %w", err)
	}
	return nil
}

// rollback ends tx, if there is one, even when ctx is cancelled.
func rollback(ctx context.Context, tx pgx.Tx) {
	if tx != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
	}
}

// process runs h in tx, which holds the message's inbox row, and commits; tx is over when it
// returns, or h panics. When it fails, transient says that the failure is not the message's (see
// isTransient).
func (ib *Inbox) process(ctx context.Context, msg *message.Message, h message.HandlerFunc, sc scope, tx pgx.Tx) (transient bool, err error) {
	committed := false
	defer func() {
		if err != nil {
			transient = isTransient(ctx, tx, err)
		}
		if !committed {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	orig := msg.Context()
	src := outbox.Source{Consumer: sc.consumer, Handler: sc.handler, DedupKey: sc.key}
	msg.SetContext(outbox.ContextWithSource(context.WithValue(orig, txKey{}, tx), src))
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
	failpoint.HitContext(ctx, "inbox.before-commit")
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("inbox: commit %s: %w", sc.key, err)
	}
	committed = true
	failpoint.HitContext(ctx, "inbox.after-commit")
	return false, nil
}

// kill moves msg to the dead-letter table and marks it dead in the inbox, in one transaction, so a
// redelivery is skipped. A nil return acknowledges the message. sc.key is empty when the message
// has no usable dedup key.
func (ib *Inbox) kill(ctx context.Context, msg *message.Message, sc scope, reason string, cause error, attempts int) error {
	if sc.key == "" {
		sc.key = ib.fallbackKey(ctx, msg)
	}
	uuid := pgtext.Sanitize(msg.UUID)
	tx, tag, err := ib.beginWithRow(ctx, ib.sql.insertDead, ib.args(ctx, sc, uuid, message.SubscribeTopicFromCtx(ctx)), nil)
	if err != nil {
		return fmt.Errorf("inbox: mark %s dead: %w", sc.key, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // A no-op after Commit.

	if tag.RowsAffected() == 0 {
		ib.hit(ctx, sc)
		return nil // Another delivery settled it first.
	}
	err = ib.dead.Add(ctx, tx, dlq.Entry{
		Source:       dlq.SourceInbox,
		Topic:        message.SubscribeTopicFromCtx(ctx),
		Consumer:     sc.consumer,
		Handler:      sc.handler,
		DedupKey:     sc.key,
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
	if _, err := tx.Exec(ctx, ib.sql.deleteAttempts, ib.args(ctx, sc)...); err != nil {
		return fmt.Errorf("inbox: clear attempts of %s: %w", sc.key, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("inbox: commit dead letter %s: %w", sc.key, err)
	}
	ib.metrics.DeadLetters.WithLabelValues(string(dlq.SourceInbox), reason).Inc()
	trace.SpanFromContext(ctx).AddEvent(eventDeadLettered, trace.WithAttributes(attrDLQReason.String(reason)))
	fields := sc.logFields()
	fields["message_uuid"], fields["reason"] = uuid, reason
	ib.logger.Error("Message moved to the dead-letter table", cause, fields) // As the relay logs its own.
	return nil
}

// fallbackKey names a message that has no usable dedup key, so that however often it is delivered
// it gets one dead letter, and each distinct message its own: its Watermill UUID when that is text
// the database can store; else where the broker delivered it from (Config.Delivery), which is the
// same for every redelivery of a record and different for every record; else a hash of what it
// carries (topic, id bytes, payload, metadata). Distinct messages that carry the same are
// indistinguishable then.
func (ib *Inbox) fallbackKey(ctx context.Context, msg *message.Message) string {
	if msg.UUID != "" && pgtext.Valid(msg.UUID) && len(msg.UUID) <= MaxDedupKeyBytes {
		return "uuid:" + msg.UUID
	}
	topic := message.SubscribeTopicFromCtx(ctx)
	if ib.cfg.Delivery != nil {
		if partition, offset, ok := ib.cfg.Delivery(ctx); ok {
			return fmt.Sprintf("kafka:%s/%d/%d", topic, partition, offset)
		}
	}
	h := sha256.New()
	field := func(s string) {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	field(topic)
	field(msg.UUID)
	field(string(msg.Payload))
	for _, k := range slices.Sorted(maps.Keys(msg.Metadata)) {
		field(k)
		field(msg.Metadata[k])
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// forgetAttempts removes the attempt counter a duplicate delivery created while the first delivery
// was still in flight; leaving it would only cost a row.
func (ib *Inbox) forgetAttempts(ctx context.Context, sc scope) {
	if ib.cfg.MaxAttempts <= 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	if _, err := ib.cfg.DB.Exec(ctx, ib.sql.deleteAttempts, ib.args(ctx, sc)...); err != nil {
		fields := sc.logFields()
		fields["error"] = err.Error()
		ib.logger.Debug("Could not clear attempts of a duplicate", fields)
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
