package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
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

// DB is what the relay needs from PostgreSQL; *pgxpool.Pool satisfies it. Every transaction and
// read goes through SendBatch: a transaction begins in the batch of its first statements (pgx's
// Batch.BeginTx), and a read is a batch that begins and commits a transaction of its own.
type DB interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Config configures a Relay. Zero values mean the documented defaults.
type Config struct {
	// DB is the database holding the outbox. Required.
	DB DB
	// Sink is where messages are published: a *KafkaSink, or a WatermillSink for other brokers.
	// Required.
	Sink Sink
	// Schema is the PostgreSQL schema holding txbox's tables. If not specified, defaults to "public".
	Schema string
	// Owner names this relay in the lease table. If not specified, defaults to
	// "<hostname>-<pid>-<random>"; it must be unique among running relays.
	Owner string
	// Shards is the number of leases the outbox's 256 slots are split into: the unit of ownership,
	// ordering and Kafka fencing. It must divide 256, and every relay of one outbox must use the same
	// value (a relay refuses to start while relays of another layout hold leases). If not specified,
	// defaults to 16.
	Shards int
	// LeaseTTL is how long a lease lasts without renewal; a dead or frozen relay's shards are taken
	// over within about one LeaseTTL of its last renewal. Leases are renewed every LeaseTTL/3. It
	// also bounds every transaction the relay runs on the lease table: a lock is waited for at most
	// LeaseTTL/4, and a session left idle inside a transaction (a process frozen mid-transaction)
	// is ended by PostgreSQL after LeaseTTL/3. Between 300ms and 10m; if not specified, defaults to
	// 10s.
	LeaseTTL time.Duration
	// BatchSize is the most rows read, published and completed together. Between 1 and 10000; if
	// not specified, defaults to 500.
	BatchSize int
	// BatchBytes bounds the payload and metadata bytes of a batch, so that large messages make
	// smaller batches and a shard holds at most about this much of them in memory; a message larger
	// than it is published alone. Between 1 KiB and 1 GiB; if not specified, defaults to 4 MiB.
	BatchBytes int
	// PollInterval is the shortest wait between two looks for new rows, used while rows keep
	// coming. One look, a single query, serves every shard of the relay that has nothing to
	// publish, and wakes those whose slots have rows; a shard with a backlog reads batch after
	// batch without waiting. Between 1ms and 1m; if not specified, defaults to 1ms.
	PollInterval time.Duration
	// IdlePollInterval is the longest wait between two looks: once 16 looks in a row found nothing,
	// each further empty look doubles the wait, from PollInterval up to IdlePollInterval. It is
	// the publish latency of the first
	// message after a quiet spell, and sets what an idle relay costs PostgreSQL (one query per
	// IdlePollInterval). At least PollInterval and at most 1m; if not specified, defaults to 25ms,
	// or to PollInterval when that is longer.
	IdlePollInterval time.Duration
	// StatsInterval is how often backlog and dead-letter gauges are refreshed. Between 10ms and 1h
	// (each refresh is a query per gauge, so a shorter interval would only load PostgreSQL); if not
	// specified, defaults to 10s.
	StatsInterval time.Duration
	// MaxPublishAttempts is how many times a message the broker refused for a reason that may pass
	// (its topic does not exist yet, the relay may not write to it) is tried before it goes to the
	// dead-letter table. Meanwhile it waits between attempts, holding back the later messages of its
	// partition key only. A message that can never be accepted as it is (an invalid topic name, a
	// record too large) goes to the dead-letter table at once. Between 1 and 1000; if not
	// specified, defaults to 10, which with the default backoffs is about three minutes.
	MaxPublishAttempts int
	// MinPublishBackoff and MaxPublishBackoff bound the wait before a refused message is tried
	// again: exponential in its attempts, with jitter. MinPublishBackoff is at least 1ms (shorter
	// would spend a message's attempts at once) and MaxPublishBackoff at most 24h; if not
	// specified, they default to 1s and 1m.
	MinPublishBackoff, MaxPublishBackoff time.Duration
	// Calls, when set, makes the relay execute side-effect calls written with outbox.Call. If not
	// specified, call rows are left pending.
	Calls *CallConfig
	// Logger receives the relay's logs. If not specified, slog.Default().
	Logger *slog.Logger
	// Registerer receives the relay's Prometheus metrics. If not specified, they are not registered.
	Registerer prometheus.Registerer
	// TracerProvider makes the relay's spans: a producer span per message published and a client
	// span per call sent, each continuing the trace stored with the row (through the global
	// OpenTelemetry propagator, as the outbox stored it). If not specified, the global
	// TracerProvider.
	TracerProvider trace.TracerProvider
}

// Defaults for Config.
const (
	DefaultShards             = 16
	DefaultLeaseTTL           = 10 * time.Second
	DefaultBatchSize          = 500
	DefaultBatchBytes         = 4 << 20
	DefaultPollInterval       = time.Millisecond
	DefaultIdlePollInterval   = 25 * time.Millisecond
	DefaultStatsInterval      = 10 * time.Second
	DefaultMaxPublishAttempts = 10
	DefaultMinPublishBackoff  = time.Second
	DefaultMaxPublishBackoff  = time.Minute
)

// Relay publishes outbox rows. Create it with New and run it with Run.
type Relay struct {
	cfg     Config
	sql     queries
	dead    *dlq.Writer
	log     *slog.Logger
	metrics *metrics.Relay
	tracer  trace.Tracer
	kafka   bool // the sink is Kafka, for the spans' messaging.system

	// publishing and calling log an outage of Kafka or of the calls' provider once per relay.
	publishing, calling *outage

	// active tells watch that a shard published rows: more are likely soon.
	active chan struct{}
	// rebalance asks Run for a balance now (see look); liveSeen is the number of live relays the
	// last balance saw; probedAt is when look last asked, used by watch's goroutine only.
	rebalance chan struct{}
	// closed carries a database failure that found the pool closed (logDB).
	closed   chan error
	liveSeen atomic.Int64
	probedAt time.Time
	// prefix is the Kafka transactional IDs' prefix ("" without transactions), set by Run before
	// anything else runs; outboxID is the outbox identity it derives from ("" when the prefix was
	// configured). Both change only when the outbox is made anew (balance), on Run's goroutine.
	prefix, outboxID string
	// warnedOf is the last relay balance found publishing beside this one with another prefix
	// (warnOtherPrefix), used by Run's goroutine only.
	warnedOf string

	mu        sync.Mutex
	held      map[int]*lease
	running   bool           // from a successful start until the stop begins, for Ready
	sinkErr   error          // why the broker did not answer at start-up (awaitSink), for Ready
	dbErr     error          // why the last round of leases failed; nil once the database answers
	layoutErr error          // why the missing leases could not be made; nil once they need not be
	stranded  bool           // calls wait in shards held by this relay, which executes none
	winding   sync.WaitGroup // workers of dropped or released leases, still stopping

	runs atomic.Bool // Run has not returned
}

// New validates cfg and returns a Relay.
func New(cfg Config) (*Relay, error) {
	if cfg.DB == nil {
		return nil, errors.New("relay: Config.DB is required")
	}
	if cfg.Sink == nil {
		return nil, errors.New("relay: Config.Sink is required")
	}
	schema, err := sqlname.Schema(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("relay: Config.Schema: %w", err)
	}
	if cfg.Shards == 0 {
		cfg.Shards = DefaultShards
	}
	if cfg.Shards < 0 || cfg.Shards > outbox.Slots || outbox.Slots%cfg.Shards != 0 {
		return nil, fmt.Errorf("relay: Config.Shards must divide %d (1, 2, 4, ... 256), got %d", outbox.Slots, cfg.Shards)
	}
	if v, ok := cfg.Sink.(interface{ validate() error }); ok {
		if err := v.validate(); err != nil {
			return nil, err
		}
	}
	setting(&err, "Config.LeaseTTL", &cfg.LeaseTTL, DefaultLeaseTTL, 300*time.Millisecond, 10*time.Minute)
	setting(&err, "Config.BatchSize", &cfg.BatchSize, DefaultBatchSize, 1, 10000)
	setting(&err, "Config.BatchBytes", &cfg.BatchBytes, DefaultBatchBytes, 1<<10, 1<<30)
	setting(&err, "Config.PollInterval", &cfg.PollInterval, DefaultPollInterval, time.Millisecond, time.Minute)
	setting(&err, "Config.IdlePollInterval", &cfg.IdlePollInterval, max(DefaultIdlePollInterval, cfg.PollInterval),
		cfg.PollInterval, time.Minute)
	setting(&err, "Config.StatsInterval", &cfg.StatsInterval, DefaultStatsInterval, 10*time.Millisecond, time.Hour)
	setting(&err, "Config.MaxPublishAttempts", &cfg.MaxPublishAttempts, DefaultMaxPublishAttempts, 1, 1000)
	setting(&err, "Config.MinPublishBackoff", &cfg.MinPublishBackoff, DefaultMinPublishBackoff, time.Millisecond, 24*time.Hour)
	setting(&err, "Config.MaxPublishBackoff", &cfg.MaxPublishBackoff, max(DefaultMaxPublishBackoff, cfg.MinPublishBackoff),
		cfg.MinPublishBackoff, 24*time.Hour)
	if err != nil {
		return nil, err
	}
	if !pgtext.Valid(cfg.Owner) {
		return nil, fmt.Errorf("relay: Config.Owner %q is not valid UTF-8 or contains NUL", cfg.Owner)
	}
	if cfg.Owner == "" {
		host, _ := os.Hostname()
		cfg.Owner = fmt.Sprintf("%s-%d-%04x", host, os.Getpid(), rand.Uint32()&0xffff)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Calls != nil {
		calls, err := cfg.Calls.resolve(cfg.LeaseTTL)
		if err != nil {
			return nil, err
		}
		cfg.Calls = &calls
	}
	dead, err := dlq.NewWriter(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = otel.GetTracerProvider()
	}
	_, kafka := cfg.Sink.(*KafkaSink)
	log := cfg.Logger.With("relay", cfg.Owner)
	return &Relay{
		cfg:        cfg,
		sql:        renderQueries(schema, outbox.Slots/cfg.Shards),
		dead:       dead,
		log:        log,
		metrics:    metrics.NewRelay(cfg.Registerer, cfg.Schema),
		tracer:     cfg.TracerProvider.Tracer(tracerName),
		kafka:      kafka,
		publishing: newOutage(log, "publishing"),
		calling:    newOutage(log, "executing calls"),
		held:       map[int]*lease{},
		active:     make(chan struct{}, 1),
		rebalance:  make(chan struct{}, 1),
		closed:     make(chan error, 1),
	}, nil
}

// Owner returns the name this relay holds leases under.
func (r *Relay) Owner() string { return r.cfg.Owner }

// Shards returns the shards this relay holds right now, with their fencing tokens.
func (r *Relay) Shards() map[int]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[int]int64, len(r.held))
	for s, l := range r.held {
		out[s] = l.token
	}
	return out
}

// ErrAlreadyRunning is returned by Run while another Run of the same Relay has not returned: two
// would share, renew and release one set of leases under one owner, and the first would report
// itself not running while it works. A Relay may run again once its Run returned.
var ErrAlreadyRunning = errors.New("relay: Run of this Relay is already running; make a Relay per concurrent Run")

// Run takes leases and publishes until ctx is cancelled, then finishes the batches in flight (for at
// most one LeaseTTL, however long the broker takes to answer), gives its leases up so other relays
// take over at once, and returns nil. It returns an error when it cannot start, and when its
// Config.DB is a pgxpool.Pool closed under it (the error matches puddle.ErrClosedPool): nothing
// could publish again. A ctx cancelled while it starts is a stop, not a failure: Run returns nil,
// having held nothing.
func (r *Relay) Run(ctx context.Context) error {
	if !r.runs.CompareAndSwap(false, true) {
		return ErrAlreadyRunning
	}
	defer r.runs.Store(false)
	failpoint.HitContext(ctx, "relay.before-start")
	// The broker first: a relay registers (in prepareLeases) only once it can publish.
	if err := r.awaitSink(ctx); err != nil {
		r.log.Info("relay stopped before it started", "error", err)
		return nil
	}
	if err := r.prepareLeases(ctx); err != nil {
		if ctx.Err() != nil && (errors.Is(err, ctx.Err()) || timedOut(err)) {
			r.log.Info("relay stopped before it started", "error", err)
			return nil
		}
		return err
	}
	started := []any{"shards", r.cfg.Shards, "lease_ttl", r.cfg.LeaseTTL}
	if r.prefix != "" {
		started = append(started, "transactional_id_prefix", r.prefix)
	}
	r.log.Info("relay started", started...)
	r.setRunning(true)
	r.metrics.LeaseTTL.Set(r.cfg.LeaseTTL.Seconds())

	err := r.serve(ctx)
	if err != nil {
		r.log.Error("relay stopped", "error", err)
	} else {
		r.log.Info("relay stopped")
	}
	return err
}

// serve balances the leases until ctx is cancelled or the database handle is closed under the
// relay, then gives them up.
func (r *Relay) serve(ctx context.Context) error {
	select {
	case <-r.closed: // left by an earlier Run's shutdown, which met the closed pool too
	default:
	}
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	var background sync.WaitGroup
	background.Go(func() { r.reportStats(ctx) })
	background.Go(func() { r.watch(ctx) })
	defer func() {
		stop()
		r.setRunning(false)
		r.shutdown()
		background.Wait()
	}()

	lost := make(chan *lease, r.cfg.Shards)
	timer := time.NewTimer(r.cfg.LeaseTTL / 3)
	defer timer.Stop()
	for {
		timer.Reset(r.balance(ctx, lost))
		select {
		case <-ctx.Done():
			return nil
		case err := <-r.closed:
			return fmt.Errorf("relay: %w", err)
		case l := <-lost:
			r.drop(l, "fenced")
		case <-r.rebalance:
		case <-timer.C:
		}
	}
}

// checkPrefix gives a KafkaSink that publishes in transactions the prefix of its transactional IDs
// (see KafkaConfig.TransactionalIDPrefix), and refuses to start beside a live relay of the outbox
// that publishes with another: their producers would not fence each other.
func (r *Relay) checkPrefix(ctx context.Context, tx pgx.Tx) error {
	k, ok := r.cfg.Sink.(*KafkaSink)
	if !ok || !k.transactional {
		return nil
	}
	var id string
	if err := tx.QueryRow(ctx, r.sql.identity).Scan(&id); err != nil {
		return fmt.Errorf("relay: read the outbox's identity (migration 00012): %w", err)
	}
	prefix, err := k.bindOutbox(id, r.outboxID)
	if err != nil {
		return err
	}
	o, err := r.otherPrefix(ctx, tx, k, prefix)
	owner, other, alive, timeout := o.owner, o.prefix, o.alive, k.transactionTimeout()
	switch {
	case err == nil && other == "" && !alive:
		// It died (kill -9, a crash) or froze: a transaction it had open holds back read_committed
		// consumers of its partitions, and a frozen one may still commit it, until the broker
		// aborts it. A producer of its transactional ID would abort it at once; ours are others.
		return fmt.Errorf("relay: relay %q, of a version before migration 00012 (it records no transactional-ID prefix), "+
			"stopped renewing its heartbeat without stopping cleanly (killed, crashed or frozen): a Kafka transaction it left open "+
			"holds back read_committed consumers of its partitions until the broker aborts it, up to %v after it began, and "+
			"this relay's producers (prefix %q, the outbox's default) would not abort it: start this relay in %v, or give it "+
			"the prefix that relay published with (KafkaConfig.TransactionalIDPrefix; that version's default is \"txbox\"), "+
			"whose producers abort it", owner, timeout, prefix, o.wait.Round(time.Second))
	case err == nil && other == "":
		// Such a relay's prefix is "txbox" unless it was configured; a configured prefix is taken
		// to be its, as an upgrade that keeps the old one sets it (README, "Transactional IDs").
		return fmt.Errorf("relay: running relay %q is of a version before migration 00012 and records no transactional-ID prefix, "+
			"so this relay's producers (prefix %q, the outbox's default) might not fence its frozen transactions: stop the relays "+
			"of the older version first, or give this relay the prefix they publish with (KafkaConfig.TransactionalIDPrefix; "+
			"that version's default is \"txbox\")", owner, prefix)
	case err == nil:
		return fmt.Errorf("relay: KafkaConfig.TransactionalIDPrefix is %q but running relay %q publishes with %q; "+
			"the relays of one outbox must share it, or a frozen relay's open Kafka transaction is not fenced: use %q, or stop them first",
			prefix, owner, other, other)
	case !errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("relay: check the transactional-ID prefix: %w", err)
	}
	r.prefix = prefix
	if k.cfg.TransactionalIDPrefix == "" {
		r.outboxID = id
	}
	return nil
}

// warnOtherPrefix logs an error, once per relay, when a live relay publishes beside this one with
// another transactional-ID prefix. checkPrefix refuses to start beside one, but a relay that starts
// later, an older version's above all (which checks nothing: a pod of the old version restarting
// during a rollout), joins anyway: each takes its share of the shards, their producers do not
// fence each other, and a frozen one can commit a batch another has published since, which the
// inbox drops as a copy; killed, it leaves transactions that hold back read_committed consumers of
// their partitions until the broker aborts them.
func (r *Relay) warnOtherPrefix(ctx context.Context, tx pgx.Tx) error {
	k, ok := r.cfg.Sink.(*KafkaSink)
	if !ok || r.prefix == "" {
		return nil
	}
	o, err := r.otherPrefix(ctx, tx, k, r.prefix)
	switch {
	case errors.Is(err, pgx.ErrNoRows) || err == nil && !o.alive:
		r.warnedOf = ""
		return nil
	case err != nil:
		return err
	case o.owner == r.warnedOf:
		return nil
	}
	r.warnedOf = o.owner
	other := o.prefix
	if other == "" {
		other = "none recorded: a version before migration 00012"
	}
	r.log.Error("a relay publishing with another transactional-ID prefix runs beside this one: their Kafka producers do not fence each other; stop it, or run every relay of the outbox with one prefix",
		"relay", o.owner, "its_prefix", other, "prefix", r.prefix)
	return nil
}

// otherRelay is a relay of the outbox that publishes with another transactional-ID prefix than
// this one's, as liveOtherPrefix finds it.
type otherRelay struct {
	owner, prefix string // prefix is "" for a relay of a version before migration 00012
	alive         bool   // its heartbeat has not run out
	wait          time.Duration
}

// otherPrefix finds a relay publishing with another prefix than prefix (pgx.ErrNoRows: none).
func (r *Relay) otherPrefix(ctx context.Context, tx pgx.Tx, k *KafkaSink, prefix string) (otherRelay, error) {
	var (
		o          otherRelay
		waitMillis int64
	)
	err := tx.QueryRow(ctx, r.sql.liveOtherPrefix, r.cfg.Owner, prefix, k.cfg.TransactionalIDPrefix != "",
		k.transactionTimeout().Milliseconds()).Scan(&o.owner, &o.prefix, &o.alive, &waitMillis)
	o.wait = time.Duration(waitMillis) * time.Millisecond
	return o, err
}

// awaitSink returns once the sink's broker answers (see Checker), or with ctx's error when ctx
// ends first. Until then the relay holds no lease and has not registered, so the running relays
// keep every shard. A broker that takes connections and answers nothing is given one LeaseTTL
// a try.
func (r *Relay) awaitSink(ctx context.Context) error {
	c, ok := r.cfg.Sink.(Checker)
	if !ok {
		return nil
	}
	for attempt := 1; ; attempt++ {
		checking, cancel := context.WithTimeoutCause(ctx, r.cfg.LeaseTTL, fmt.Errorf("the broker has not answered for %v", r.cfg.LeaseTTL))
		err := c.Check(checking)
		cancel()
		r.mu.Lock()
		r.sinkErr = err
		r.mu.Unlock()
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case err == nil && attempt > 1:
			r.log.Info("the broker answers now")
			return nil
		case err == nil:
			return nil
		case attempt == 1:
			r.log.Error("the broker does not answer; taking no shard until it does", "error", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(min(backoff(attempt), r.cfg.LeaseTTL)):
		}
	}
}

func (r *Relay) setRunning(running bool) {
	r.mu.Lock()
	r.running = running
	r.mu.Unlock()
}

// prepareLeases makes sure the lease table has this relay's layout, refusing to change it while
// relays of another layout hold leases. It takes no table lock, waits for no lease row, and retries
// while its bounded waits run out, so a relay starting never delays the others' renewals.
func (r *Relay) prepareLeases(ctx context.Context) error {
	for attempt := 1; ; attempt++ {
		err := r.bounded(ctx, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, r.sql.layoutLock); err != nil {
				return fmt.Errorf("relay: lock lease layout: %w", err)
			}
			var other int
			err := tx.QueryRow(ctx, r.sql.liveOtherLayout, r.cfg.Shards, r.cfg.Owner).Scan(&other)
			if err == nil {
				return fmt.Errorf("relay: Config.Shards is %d but running relays hold leases of a %d-shard layout; stop them (or wait one lease TTL) before changing it, or use %d", r.cfg.Shards, other, other)
			}
			if !errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("relay: check lease layout: %w", err)
			}
			if _, err := tx.Exec(ctx, r.sql.dropOtherLayout, r.cfg.Shards); err != nil {
				return fmt.Errorf("relay: drop old lease layout: %w", err)
			}
			if _, err := tx.Exec(ctx, r.sql.createLeases, r.cfg.Shards); err != nil {
				return fmt.Errorf("relay: create leases: %w", err)
			}
			if err := r.checkPrefix(ctx, tx); err != nil {
				return err
			}
			// Registered under the layout lock, in the transaction that checked: a relay starting
			// at the same moment with another layout or prefix sees this one, and is refused.
			_, err = tx.Exec(ctx, r.sql.heartbeat, r.cfg.Owner, r.cfg.LeaseTTL.Milliseconds(), r.prefix, r.cfg.Shards)
			return err
		})
		if err == nil {
			return r.retireShards(ctx)
		}
		if !timedOut(err) || ctx.Err() != nil {
			return err
		}
		if attempt == 1 {
			r.log.Warn("preparing the lease table timed out; retrying", "error", err)
		}
		t := time.NewTimer(backoff(attempt))
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

// retireShards forgets the leases of the shards that a layout of fewer shards drops, once nothing
// can publish under them. Their transactional IDs (<prefix>-shard-<n>, n ≥ Config.Shards) are no
// producer's in this layout, so nothing would abort a Kafka transaction that a relay of the old
// layout, killed or frozen, left open under one: read_committed consumers of its partitions would
// receive nothing until the broker's transaction timeout aborted it, and a frozen relay could still
// commit it when it woke. A producer opened under each ID aborts it and fences that relay; only
// then go the lease rows, the only record of those IDs. If that fails, the rows stay for the next
// relay to start.
func (r *Relay) retireShards(ctx context.Context) error {
	var shards []int
	err := r.bounded(ctx, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, r.sql.retiredLeases, r.cfg.Shards)
		if err == nil {
			shards, err = pgx.CollectRows(rows, pgx.RowTo[int])
		}
		return err
	})
	switch {
	case err != nil:
		return fmt.Errorf("relay: read the leases of shards beyond Config.Shards: %w", err)
	case len(shards) == 0:
		return nil
	}
	if k, ok := r.cfg.Sink.(*KafkaSink); ok && k.transactional {
		if err := k.fence(ctx, shards); err != nil {
			return fmt.Errorf("relay: Config.Shards is %d, fewer than before: fence the Kafka transactional IDs of shards %v, which it drops: %w",
				r.cfg.Shards, shards, err)
		}
	}
	err = r.bounded(ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, r.sql.dropRetired, r.cfg.Shards, shards)
		return err
	})
	if err != nil {
		return fmt.Errorf("relay: drop the leases of shards beyond Config.Shards: %w", err)
	}
	r.log.Info("retired the shards of a layout with more shards", "shards", shards)
	return nil
}

// bounded runs fn in a transaction whose waits are bounded by the lease TTL (see setBounds): a lock
// is waited for at most LeaseTTL/4, a statement runs at most LeaseTTL, and a session left idle in
// the transaction is ended after LeaseTTL/3. Every transaction the relay runs on leases and on
// rows it completes goes through it.
func (r *Relay) bounded(ctx context.Context, fn func(pgx.Tx) error) error {
	return r.boundedWith(ctx, nil, fn)
}

// boundedWith is bounded with the statements first queues sent in the same round trip as the
// BEGIN and the bounds (pgx's Batch.BeginTx), before fn runs. Its statements run with generic plans
// (genericPlans).
func (r *Relay) boundedWith(ctx context.Context, first func(*pgx.Batch), fn func(pgx.Tx) error) error {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	r.queueBounds(b, r.cfg.LeaseTTL)
	if first != nil {
		first(b)
	}
	results := r.cfg.DB.SendBatch(ctx, b)
	tx := results.Tx()
	err := results.Close()
	if tx == nil {
		return errors.Join(err, errors.New("relay: Config.DB's SendBatch does not begin the transaction of a pgx.Batch.BeginTx"))
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // A no-op after Commit; also when fn panics.
	if err != nil {
		if first == nil {
			return fmt.Errorf("relay: bound transaction: %w", err)
		}
		return err
	}
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// read runs query, a read, in a transaction of its own, bounded as bounded's statements are but for
// its statement timeout (at least minReadTimeout), and with generic plans, in one round trip: the
// begin, the bounds, the read and the commit go in one batch. A read that fails leaves its
// connection in the failed transaction, which *pgxpool.Pool then closes rather than reuse.
func (r *Relay) read(ctx context.Context, query string, args []any, scan func(pgx.Rows) error) error {
	return r.readWith(ctx, func(b *pgx.Batch) { b.Queue(query, args...).Query(scan) })
}

// readWith is read with the statements queue queues.
func (r *Relay) readWith(ctx context.Context, queue func(*pgx.Batch)) error {
	b := &pgx.Batch{}
	b.Queue(beginReadCommitted)
	r.queueBounds(b, max(r.cfg.LeaseTTL, minReadTimeout))
	queue(b)
	b.Queue("commit")
	return r.cfg.DB.SendBatch(ctx, b).Close()
}

// reads is a dlq.Querier whose every QueryRow is a read of its own (Relay.read).
type reads struct{ r *Relay }

func (q reads) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return readRow{reads: q, ctx: ctx, sql: sql, args: args}
}

// readRow runs its read when it is scanned.
type readRow struct {
	reads
	ctx  context.Context
	sql  string
	args []any
}

func (row readRow) Scan(dest ...any) error {
	return row.r.readWith(row.ctx, func(b *pgx.Batch) {
		b.Queue(row.sql, row.args...).QueryRow(func(r pgx.Row) error { return r.Scan(dest...) })
	})
}

// beginReadCommitted begins every read of the relay, read only, and read committed whatever the
// database's default_transaction_isolation (the relay's transactions begin read committed too,
// through pgx.TxOptions). With repeatable read or serializable, lease rows that another relay
// updated fail the relay's transactions ("could not serialize access"), relays starting together
// fail to start, and the relay's reads of pending rows make the application's serializable
// transactions that write to the outbox fail to serialize. The relay's fence is the lease row
// lock, not the isolation level (TestARelayOnASerializableDatabaseLeavesItsWritersAlone).
const beginReadCommitted = "begin isolation level read committed read only"

// minReadTimeout is the least statement timeout of a read (Relay.read). Such a read holds
// no lock anyone waits for, so a slow one delays only its own shard; but its first run on a
// connection includes planning it, which for a shard of many slots takes hundreds of milliseconds
// on an idle server (~300 ms for the 256 slots of --shards 1) and several times that on a busy
// one. A read cut short is planned again at its next attempt, so a timeout of one short LeaseTTL
// could stall the shard for good.
const minReadTimeout = 10 * time.Second

// queueBounds queues the relay's bounds (see bounded) with the given statement timeout, and with
// generic plans.
func (r *Relay) queueBounds(b *pgx.Batch, statement time.Duration) {
	ttl := r.cfg.LeaseTTL
	queueBounds(b, ttl/4, statement, ttl/3, genericPlans)
}

// inBoundedTx runs a transaction of db with the given lock, statement and idle timeouts: its first
// round trip sets them and runs the statements first queues (nil: none), then fn runs. Each
// statement of the round trip runs under the bounds, which PostgreSQL applies per statement.
func inBoundedTx(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, lock, statement, idle time.Duration, first func(*pgx.Batch), fn func(pgx.Tx) error,
) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		queueBounds(b, lock, statement, idle, "")
		if first != nil {
			first(b)
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			if first == nil {
				return fmt.Errorf("relay: bound transaction: %w", err)
			}
			return err
		}
		return fn(tx)
	})
}

// queueBounds queues setBounds with the given lock, statement and idle timeouts and plan mode
// ("": the session's).
func queueBounds(b *pgx.Batch, lock, statement, idle time.Duration, plans string) {
	ms := func(d time.Duration) string { return strconv.FormatInt(max(d.Milliseconds(), 1), 10) }
	b.Queue(setBounds, ms(lock), ms(statement), ms(idle), plans).Exec(func(pgconn.CommandTag) error { return nil })
}

// timedOut reports whether err is a bounded wait running out (a lock, a statement, a session idle
// in its transaction) rather than a failure that retrying cannot fix.
func timedOut(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "55P03" || pgErr.Code == "57014" || pgErr.Code == "25P03")
}

// expirySlack is how long after a lease or relay runs out, by the database's clock, a relay looks
// for leases to take: a little later than the expiry, so that it has passed when the look runs.
const expirySlack = 20 * time.Millisecond

// balance renews the leases held, then takes or gives up leases so that each live relay holds its
// fair share, and returns how long to wait before the next round: until LeaseTTL/3 after this
// round began, or less when another relay's lease or heartbeat runs out sooner, so that a dead or
// frozen relay's shards are taken over right when its leases run out. Errors are logged and
// retried on the next round: a relay whose database is away loses its leases by expiry, and the
// fence keeps it from doing harm meanwhile.
func (r *Relay) balance(ctx context.Context, lost chan<- *lease) (next time.Duration) {
	// Renewals run every LeaseTTL/3 from the start of one to the start of the next, however long
	// the round takes: waiting LeaseTTL/3 after a round that a loaded database or machine had
	// slowed to a second left a 1.5 s lease to run out between two renewals, with nothing wrong.
	began := time.Now()
	defer func() { next = max(next-time.Since(began), 0) }()
	next = r.cfg.LeaseTTL / 3
	if ctx.Err() != nil {
		return next
	}
	// A round that has not ended after one TTL has lost its leases anyway, and a database path
	// that hangs (rather than refuses) would otherwise hold the loop, unlogged and unseen by Ready.
	round, cancel := context.WithTimeoutCause(ctx, r.cfg.LeaseTTL, fmt.Errorf("the database has not answered for %v", r.cfg.LeaseTTL))
	defer cancel()
	ttl := r.cfg.LeaseTTL.Milliseconds()
	if err := r.renew(round, ttl); err != nil {
		r.logDB("renew leases", err)
		r.dropRunOut()
		return next
	}
	// Who is alive and when the next lease or relay of others runs out are read at one instant:
	// a relay counted alive here is the expiry to wake up for.
	var (
		live   int
		wake   *int64
		newID  string
		layout error // why the missing leases could not be made, for Ready
	)
	defer func() { r.setLayoutErr(layout) }()
	err := r.bounded(round, func(tx pgx.Tx) error {
		if r.outboxID != "" {
			// Read before the heartbeat, so that a relay never registers in an outbox made anew
			// with the prefix of the one before: relays that start there would be refused.
			var id string
			if err := tx.QueryRow(round, r.sql.identity).Scan(&id); err != nil {
				return err
			}
			if id != r.outboxID {
				newID = id
				return nil
			}
		}
		if _, err := tx.Exec(round, r.sql.heartbeat, r.cfg.Owner, ttl, r.prefix, r.cfg.Shards); err != nil {
			return err
		}
		if _, err := tx.Exec(round, r.sql.pruneNodes); err != nil {
			return err
		}
		if err := r.warnOtherPrefix(round, tx); err != nil {
			return err
		}
		if err := tx.QueryRow(round, r.sql.liveNodes).Scan(&live); err != nil {
			return err
		}
		return tx.QueryRow(round, r.sql.nextExpiry, r.cfg.Owner, r.cfg.Shards).Scan(&wake)
	})
	if err != nil {
		r.logDB("heartbeat", err)
		return next
	}
	r.dbOK()
	if newID != "" {
		// txbox migrate down and up under the running relay: every table is new, and so is the
		// identity its default prefix derives from. Its leases went with the old tables; a
		// producer left open on one would publish under the old prefix.
		r.log.Warn("the outbox was made anew (migrated down and up): its transactional-ID prefix derives from its new identity",
			"old_prefix", r.prefix, "prefix", outboxPrefix(newID))
		r.mu.Lock()
		held := slices.Collect(maps.Values(r.held))
		r.mu.Unlock()
		for _, l := range held {
			r.drop(l, "the outbox was made anew")
		}
		if err := r.prepareLeases(round); err != nil {
			layout = err
			r.log.Error("could not make the leases of the new outbox", "error", err)
			return next
		}
		r.log.Info("relay registered in the new outbox", "transactional_id_prefix", r.prefix)
		return 0 // Take the leases now.
	}
	r.liveSeen.Store(int64(live))
	if wake != nil {
		next = min(next, time.Since(began)+max(time.Duration(*wake)*time.Millisecond, 0)+expirySlack)
	}
	fair := (r.cfg.Shards + max(live, 1) - 1) / max(live, 1)

	r.mu.Lock()
	n := len(r.held)
	r.mu.Unlock()
	switch {
	case n < fair:
		var (
			got     []*lease
			missing int
		)
		// A stop that comes while the leases are being taken must not cut the commit's answer
		// off: the leases would be taken unknown to the relay, and held, unreleased, for a TTL.
		// The taking finishes (bounded by the round's deadline), and the stop releases them.
		deadline, _ := round.Deadline()
		acquiring, stopAcquiring := context.WithDeadline(context.WithoutCancel(round), deadline)
		defer stopAcquiring()
		began := time.Now()
		err := r.bounded(acquiring, func(tx pgx.Tx) error {
			rows, err := tx.Query(acquiring, r.sql.acquire, r.cfg.Owner, ttl, r.cfg.Shards, fair-n)
			if err != nil {
				return err
			}
			got, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (*lease, error) {
				l := &lease{}
				return l, row.Scan(&l.shard, &l.token)
			})
			if err != nil || len(got) == fair-n {
				return err
			}
			return tx.QueryRow(acquiring, r.sql.missingLeases, r.cfg.Shards).Scan(&missing)
		})
		if err != nil {
			r.logDB("acquire leases", err)
			return next
		}
		for _, l := range got {
			l.until = began.Add(r.cfg.LeaseTTL)
			r.start(ctx, l, lost)
		}
		if missing > 0 {
			// The lease table was made again (txbox migrate down and up) or rows were deleted:
			// without them no relay would ever hold those shards again, their rows left unpublished.
			r.log.Warn("the lease table lacks leases of this layout; making them again", "missing", missing, "shards", r.cfg.Shards)
			if err := r.prepareLeases(round); err != nil {
				layout = err
				r.log.Error("could not make the missing leases", "error", err)
			} else {
				next = 0 // Take them now.
			}
		}
	case n > fair:
		r.mu.Lock()
		var extra []*lease
		for _, l := range r.held {
			if len(extra) < n-fair {
				extra = append(extra, l)
			}
		}
		r.mu.Unlock()
		for _, l := range extra {
			r.release(l)
		}
	}
	return next
}

func (r *Relay) renew(ctx context.Context, ttl int64) error {
	r.mu.Lock()
	shards := make([]int32, 0, len(r.held))
	tokens := make([]int64, 0, len(r.held))
	for _, l := range r.held {
		shards = append(shards, int32(l.shard))
		tokens = append(tokens, l.token)
	}
	r.mu.Unlock()
	if len(shards) == 0 {
		return nil
	}
	began := time.Now()
	var renewed []int32
	err := r.bounded(ctx, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, r.sql.renew, shards, tokens, ttl)
		if err != nil {
			return err
		}
		renewed, err = pgx.CollectRows(rows, pgx.RowTo[int32])
		return err
	})
	if err != nil {
		return err
	}
	kept := make(map[int]bool, len(renewed))
	for _, s := range renewed {
		kept[int(s)] = true
	}
	left := r.cfg.LeaseTTL // of the lease closest to running out, before this renewal
	for i, s := range shards {
		r.mu.Lock()
		l := r.held[int(s)]
		r.mu.Unlock()
		switch {
		case l == nil || l.token != tokens[i]:
		case kept[int(s)]:
			left = min(left, time.Until(l.until))
			l.until = began.Add(r.cfg.LeaseTTL)
		default:
			r.drop(l, "lease taken over")
		}
	}
	// A renewal is due LeaseTTL/3 after the last began, and commits at once: a machine or database
	// this busy is close to letting live leases run out, or has.
	switch {
	case left < 0:
		r.log.Warn("leases renewed after they had run out (the process or the database was held up); another relay may have taken some",
			"ran_out_ago", (-left).Round(time.Millisecond), "lease_ttl", r.cfg.LeaseTTL)
	case left < r.cfg.LeaseTTL/3:
		r.log.Warn("leases renewed late: little of them was left", "left", left.Round(time.Millisecond), "lease_ttl", r.cfg.LeaseTTL)
	}
	return nil
}

// dropRunOut drops the leases whose last renewal (or acquisition) began more than one LeaseTTL
// ago: by the database's clock they ran out, free for another relay to take, and the relay must
// stop counting them as held (txbox_relay_shards_held, Shards) while it cannot reach the database
// to renew them. The relay's own clock only ever gives a lease up this way, never keeps one, and
// measured from before the transaction began, it gives the lease up at most one round trip before
// the database's clock runs it out; giving a lease up early is always safe.
func (r *Relay) dropRunOut() {
	r.mu.Lock()
	var out []*lease
	for _, l := range r.held {
		if time.Now().After(l.until) {
			out = append(out, l)
		}
	}
	r.mu.Unlock()
	for _, l := range out {
		r.abandon(l, "lease ran out unrenewed; shard dropped", "the database did not answer the renewals")
	}
}

// start runs a worker for a newly acquired lease.
func (r *Relay) start(ctx context.Context, l *lease, lost chan<- *lease) {
	l.relay = r
	l.slots = slotsOf(l.shard, r.cfg.Shards)
	l.stop = make(chan struct{})
	l.done = make(chan struct{})
	l.forgotten = make(chan struct{})
	l.wake = make(chan struct{}, 1)
	l.dueSlot.Store(noSlot)
	// The worker's context is cancelled only when the lease is lost; a graceful stop lets the batch
	// in flight finish first.
	l.ctx, l.cancel = context.WithCancel(context.WithoutCancel(ctx))
	r.mu.Lock()
	r.held[l.shard] = l
	r.mu.Unlock()
	r.metrics.ShardsHeld.Inc()
	r.log.Info("lease acquired", "shard", l.shard, "token", l.token)
	go func() {
		defer close(l.done)
		// Messages and calls of the shard run side by side; when either finds the lease fenced,
		// both stop.
		var fenced atomic.Bool
		var wg sync.WaitGroup
		workers := []func() bool{l.run}
		if r.cfg.Calls != nil {
			workers = append(workers, l.runCalls)
		}
		for _, work := range workers {
			wg.Go(func() {
				if work() {
					fenced.Store(true)
					l.cancel()
				}
			})
		}
		wg.Wait()
		if fenced.Load() {
			// A lease already dropped or released is forgotten: nobody needs the news.
			select {
			case lost <- l:
			case <-l.forgotten:
			}
		}
	}()
}

// forget removes l from the leases held; false means it was already dropped or released.
func (r *Relay) forget(l *lease) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.held[l.shard] != l {
		return false
	}
	delete(r.held, l.shard)
	close(l.forgotten)
	r.metrics.ShardsHeld.Dec()
	return true
}

// drop abandons a lease that is no longer this relay's: in-flight work is cancelled, not
// finished. The worker winds down in the background so the other leases keep being renewed.
func (r *Relay) drop(l *lease, why string) {
	if r.abandon(l, "lease lost; shard dropped", why) {
		r.metrics.Fenced.Inc()
	}
}

// abandon stops the worker of l at once and forgets the lease, logging msg; it reports whether
// the relay still counted the lease as held.
func (r *Relay) abandon(l *lease, msg, why string) bool {
	if !r.forget(l) {
		return false
	}
	l.cancel()
	r.log.Warn(msg, "shard", l.shard, "token", l.token, "why", why)
	r.winding.Go(func() { <-l.done })
	return true
}

// release lets the lease's batch in flight finish (for at most one LeaseTTL), then gives the lease
// up for another relay to take. It returns at once; shutdown waits for it.
func (r *Relay) release(l *lease) {
	if !r.forget(l) {
		return
	}
	close(l.stop)
	r.winding.Go(func() {
		select {
		case <-l.done:
		case <-time.After(r.cfg.LeaseTTL):
		}
		l.cancel()
		<-l.done
		ctx, cancel := context.WithTimeout(context.Background(), r.cfg.LeaseTTL)
		defer cancel()
		err := r.bounded(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, r.sql.release, l.shard, l.token)
			return err
		})
		if err != nil {
			r.log.Warn("could not release lease; it will expire", "shard", l.shard, "error", err)
			return
		}
		r.log.Info("lease released", "shard", l.shard, "token", l.token)
	})
}

func (r *Relay) shutdown() {
	r.mu.Lock()
	all := make([]*lease, 0, len(r.held))
	for _, l := range r.held {
		all = append(all, l)
	}
	r.mu.Unlock()
	for _, l := range all {
		r.release(l)
	}
	r.winding.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.LeaseTTL)
	defer cancel()
	err := r.bounded(ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, r.sql.forgetNode, r.cfg.Owner)
		return err
	})
	if err != nil {
		r.log.Warn("could not deregister relay", "error", err)
	}
}

// The bounds of the gauges' query (sql.go, stats): exact up to statsCountLimit pending rows,
// about 10 ms of server time here; the oldest among the first statsOldestAmong.
const (
	statsCountLimit  = 100_000
	statsOldestAmong = 10_000
)

// reportStats refreshes the backlog and dead-letter gauges.
func (r *Relay) reportStats(ctx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	for {
		var backlog int64
		var oldest float64
		if err := (reads{r}).QueryRow(ctx, r.sql.stats, statsCountLimit, statsOldestAmong).Scan(&backlog, &oldest); err == nil {
			r.metrics.Backlog.Set(float64(backlog))
			r.metrics.OldestPending.Set(oldest)
		}
		if depths, err := dlq.Stats(ctx, reads{r}, r.cfg.Schema); err == nil {
			for source, d := range depths {
				r.metrics.DLQDepth.WithLabelValues(string(source)).Set(float64(d.Count))
				r.metrics.DLQAge.WithLabelValues(string(source)).Set(d.OldestAgeSeconds)
			}
			r.metrics.StatsTime.SetToCurrentTime()
		}
		if r.cfg.Calls == nil {
			r.checkStranded(ctx)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// errStranded is Ready's problem while calls wait in shards held by a relay that executes none.
var errStranded = errors.New("calls: side-effect calls wait in shards this relay holds, and it executes none (Config.Calls is not set; txbox relay: STRIPE_API_KEY is not set)")

// checkStranded looks for calls in the shards held by this relay, which executes none: in a fleet
// where some relays lack the provider's key, the calls of the shards they hold would wait for
// ever, with every relay ready and nothing in the log.
func (r *Relay) checkStranded(ctx context.Context) {
	var slots []int16
	r.mu.Lock()
	for shard := range r.held {
		slots = append(slots, slotsOf(shard, r.cfg.Shards)...)
	}
	r.mu.Unlock()
	stranded := false
	if len(slots) > 0 {
		if err := (reads{r}).QueryRow(ctx, r.sql.strandedCalls, slots).Scan(&stranded); err != nil {
			return // The database's trouble is reported by the lease rounds.
		}
	}
	r.mu.Lock()
	was := r.stranded
	r.stranded = stranded
	r.mu.Unlock()
	switch {
	case stranded && !was:
		r.log.Warn("side-effect calls wait in shards this relay holds, and it executes none: run every relay of the outbox with the provider's key (STRIPE_API_KEY), or the calls of the shards a relay without it holds are never done")
	case !stranded && was:
		r.log.Info("no call waits in the shards this relay holds any more")
	}
}

// setting gives a zero setting its default and checks that it lies within [lo, hi], setting *err
// to an error that names the field if it does not. Once *err is set it does nothing, so a
// constructor checks its settings one after the other and reports the first bad one.
func setting[T int | time.Duration](err *error, field string, v *T, def, lo, hi T) {
	if *err != nil {
		return
	}
	if *v == 0 {
		*v = def
	}
	switch {
	case *v < lo && lo == 1:
		*err = fmt.Errorf("relay: %s must be positive (zero means the default, %v), got %v", field, def, *v)
	case *v < lo:
		*err = fmt.Errorf("relay: %s must be at least %v, got %v", field, lo, *v)
	case *v > hi:
		*err = fmt.Errorf("relay: %s must be at most %v, got %v", field, hi, *v)
	}
}

// slotsOf lists the outbox slots that belong to shard.
func slotsOf(shard, shards int) []int16 {
	slots := make([]int16, 0, outbox.Slots/shards)
	for s := shard; s < outbox.Slots; s += shards {
		slots = append(slots, int16(s))
	}
	return slots
}

// ShardOf returns the shard that a partition key's messages belong to under a layout of shards.
func ShardOf(partitionKey, uuid string, shards int) int {
	return int(outbox.SlotOf(partitionKey, uuid)) % shards
}

// logDB logs a failure of the lease rounds once per database outage, and keeps it for Ready. A
// closed pool is no outage: it never comes back, so Run stops.
func (r *Relay) logDB(what string, err error) {
	if errors.Is(err, context.Canceled) {
		return
	}
	err = fmt.Errorf("%s: %w", what, err)
	if errors.Is(err, puddle.ErrClosedPool) {
		select {
		case r.closed <- err:
		default:
		}
	}
	r.mu.Lock()
	first := r.dbErr == nil
	r.dbErr = err
	r.mu.Unlock()
	if first {
		r.log.Error("database unavailable; retrying every lease tick", "error", err)
	}
}

// setLayoutErr keeps for Ready why the last balance could not make the leases it lacked.
func (r *Relay) setLayoutErr(err error) {
	r.mu.Lock()
	r.layoutErr = err
	r.mu.Unlock()
}

func (r *Relay) dbOK() {
	r.mu.Lock()
	was := r.dbErr != nil
	r.dbErr = nil
	r.mu.Unlock()
	if was {
		r.log.Info("database reachable again")
	}
}

// ErrNotReady is wrapped by every error Ready returns.
var ErrNotReady = errors.New("relay: not ready")

// Ready reports whether the relay is doing its work: nil while Run runs, the database answered
// the relay's last round of leases, the relay could make the leases the table lacked, no shard
// meets an outage of Kafka or of the calls' provider, and, for a relay without Config.Calls, no
// call waits in a shard it holds (checked every StatsInterval); otherwise an error wrapping
// ErrNotReady that says what is wrong (all of it). txbox relay serves it at /readyz, so that a
// rolling deployment waits for a new relay to start and an orchestrator sees one that cannot
// work.
func (r *Relay) Ready() error {
	r.mu.Lock()
	running, dbErr, sinkErr, layoutErr, stranded := r.running, r.dbErr, r.sinkErr, r.layoutErr, r.stranded
	r.mu.Unlock()
	switch {
	case !running && sinkErr != nil:
		return fmt.Errorf("%w: waiting for the broker to answer, holding no shard: %w", ErrNotReady, sinkErr)
	case !running:
		return fmt.Errorf("%w: not running (starting or stopping)", ErrNotReady)
	}
	var problems []error
	if dbErr != nil {
		problems = append(problems, fmt.Errorf("database: %w", dbErr))
	}
	if layoutErr != nil {
		problems = append(problems, fmt.Errorf("leases: %w", layoutErr))
	}
	if stranded {
		problems = append(problems, errStranded)
	}
	for _, o := range []*outage{r.publishing, r.calling} {
		if err := o.err(); err != nil {
			problems = append(problems, err)
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrNotReady, errors.Join(problems...))
}
