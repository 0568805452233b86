package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/metrics"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/outbox"
)

// DB is what the relay needs from PostgreSQL; *pgxpool.Pool satisfies it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
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
	// LeaseTTL is how long a lease lasts without renewal; a dead relay's shards are taken over within
	// about one LeaseTTL. Leases are renewed every LeaseTTL/3. If not specified, defaults to 10s.
	LeaseTTL time.Duration
	// BatchSize is the most rows read, published and completed together. If not specified, defaults
	// to 500.
	BatchSize int
	// PollInterval is how long an idle shard waits before looking for new rows again: the publish
	// latency at low load. If not specified, defaults to 25ms.
	PollInterval time.Duration
	// StatsInterval is how often backlog and dead-letter gauges are refreshed. If not specified,
	// defaults to 10s.
	StatsInterval time.Duration
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
	DefaultShards        = 16
	DefaultLeaseTTL      = 10 * time.Second
	DefaultBatchSize     = 500
	DefaultPollInterval  = 25 * time.Millisecond
	DefaultStatsInterval = 10 * time.Second
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

	mu        sync.Mutex
	held      map[int]*lease
	dbFailing bool           // so a database outage is logged once, not on every tick
	winding   sync.WaitGroup // workers of dropped or released leases, still stopping
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
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.LeaseTTL < 300*time.Millisecond {
		return nil, fmt.Errorf("relay: Config.LeaseTTL must be at least 300ms, got %s", cfg.LeaseTTL)
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.BatchSize < 0 || cfg.BatchSize > 10000 {
		return nil, fmt.Errorf("relay: Config.BatchSize must be between 1 and 10000, got %d", cfg.BatchSize)
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.PollInterval < 0 {
		return nil, fmt.Errorf("relay: Config.PollInterval must be positive, got %s", cfg.PollInterval)
	}
	if cfg.StatsInterval == 0 {
		cfg.StatsInterval = DefaultStatsInterval
	}
	if cfg.Owner == "" {
		host, _ := os.Hostname()
		cfg.Owner = fmt.Sprintf("%s-%d-%04x", host, os.Getpid(), rand.Uint32()&0xffff)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Calls != nil {
		if err := cfg.Calls.validate(); err != nil {
			return nil, fmt.Errorf("relay: Config.Calls: %w", err)
		}
	}
	dead, err := dlq.NewWriter(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("relay: %w", err)
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = otel.GetTracerProvider()
	}
	_, kafka := cfg.Sink.(*KafkaSink)
	return &Relay{
		cfg:     cfg,
		sql:     renderQueries(schema),
		dead:    dead,
		log:     cfg.Logger.With("relay", cfg.Owner),
		metrics: metrics.NewRelay(cfg.Registerer, cfg.Schema),
		tracer:  cfg.TracerProvider.Tracer(tracerName),
		kafka:   kafka,
		held:    map[int]*lease{},
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

// Run takes leases and publishes until ctx is cancelled, then finishes the batches in flight (for at
// most one LeaseTTL), gives its leases up so other relays take over at once, and returns nil.
// It returns an error only when it cannot start.
func (r *Relay) Run(ctx context.Context) error {
	if err := r.prepareLeases(ctx); err != nil {
		return err
	}
	r.log.Info("relay started", "shards", r.cfg.Shards, "lease_ttl", r.cfg.LeaseTTL)
	r.metrics.LeaseTTL.Set(r.cfg.LeaseTTL.Seconds())

	statsDone := make(chan struct{})
	go func() {
		defer close(statsDone)
		r.reportStats(ctx)
	}()

	lost := make(chan *lease, r.cfg.Shards)
	tick := time.NewTicker(r.cfg.LeaseTTL / 3)
	defer tick.Stop()
	for {
		r.balance(ctx, lost)
		select {
		case <-ctx.Done():
			r.shutdown()
			<-statsDone
			r.log.Info("relay stopped")
			return nil
		case l := <-lost:
			r.drop(l, "fenced")
		case <-tick.C:
		}
	}
}

// prepareLeases makes sure the lease table has this relay's layout, refusing to change it while
// relays of another layout hold leases.
func (r *Relay) prepareLeases(ctx context.Context) error {
	return pgx.BeginFunc(ctx, r.cfg.DB, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, r.sql.lockLeases); err != nil {
			return fmt.Errorf("relay: lock leases: %w", err)
		}
		var other int
		err := tx.QueryRow(ctx, r.sql.liveOtherLayout, r.cfg.Shards).Scan(&other)
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
		return nil
	})
}

// balance renews the leases held, then takes or gives up leases so that each live relay holds its
// fair share. Errors are logged and retried on the next tick: a relay whose database is away loses
// its leases by expiry, and the fence keeps it from doing harm meanwhile.
func (r *Relay) balance(ctx context.Context, lost chan<- *lease) {
	if ctx.Err() != nil {
		return
	}
	ttl := r.cfg.LeaseTTL.Milliseconds()
	if err := r.renew(ctx, ttl); err != nil {
		r.logDB("renew leases", err)
		return
	}
	var live int
	if _, err := r.cfg.DB.Exec(ctx, r.sql.heartbeat, r.cfg.Owner, ttl); err != nil {
		r.logDB("heartbeat", err)
		return
	}
	if err := r.cfg.DB.QueryRow(ctx, r.sql.liveNodes).Scan(&live); err != nil {
		r.logDB("count relays", err)
		return
	}
	r.dbOK()
	fair := (r.cfg.Shards + max(live, 1) - 1) / max(live, 1)

	r.mu.Lock()
	n := len(r.held)
	r.mu.Unlock()
	switch {
	case n < fair:
		rows, err := r.cfg.DB.Query(ctx, r.sql.acquire, r.cfg.Owner, ttl, r.cfg.Shards, fair-n)
		if err != nil {
			r.logDB("acquire leases", err)
			return
		}
		var got []*lease
		for rows.Next() {
			l := &lease{}
			if err := rows.Scan(&l.shard, &l.token); err != nil {
				rows.Close()
				r.logDB("acquire leases", err)
				return
			}
			got = append(got, l)
		}
		if err := rows.Err(); err != nil {
			r.logDB("acquire leases", err)
			return
		}
		for _, l := range got {
			r.start(ctx, l, lost)
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
	if _, err := r.cfg.DB.Exec(ctx, r.sql.pruneNodes); err != nil {
		r.logDB("prune relays", err)
	}
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
	rows, err := r.cfg.DB.Query(ctx, r.sql.renew, shards, tokens, ttl)
	if err != nil {
		return err
	}
	renewed, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return err
	}
	kept := make(map[int]bool, len(renewed))
	for _, s := range renewed {
		kept[int(s)] = true
	}
	for _, s := range shards {
		if !kept[int(s)] {
			r.mu.Lock()
			l := r.held[int(s)]
			r.mu.Unlock()
			if l != nil {
				r.drop(l, "lease taken over")
			}
		}
	}
	return nil
}

// start runs a worker for a newly acquired lease.
func (r *Relay) start(ctx context.Context, l *lease, lost chan<- *lease) {
	l.relay = r
	l.slots = slotsOf(l.shard, r.cfg.Shards)
	l.stop = make(chan struct{})
	l.done = make(chan struct{})
	l.forgotten = make(chan struct{})
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
	if !r.forget(l) {
		return
	}
	l.cancel()
	r.metrics.Fenced.Inc()
	r.log.Warn("lease lost; shard dropped", "shard", l.shard, "token", l.token, "why", why)
	r.winding.Go(func() { <-l.done })
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
		if _, err := r.cfg.DB.Exec(ctx, r.sql.release, l.shard, l.token); err != nil {
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
	if _, err := r.cfg.DB.Exec(ctx, r.sql.forgetNode, r.cfg.Owner); err != nil {
		r.log.Warn("could not deregister relay", "error", err)
	}
}

// reportStats refreshes the backlog and dead-letter gauges.
func (r *Relay) reportStats(ctx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	for {
		var backlog int64
		var oldest float64
		if err := r.cfg.DB.QueryRow(ctx, r.sql.stats).Scan(&backlog, &oldest); err == nil {
			r.metrics.Backlog.Set(float64(backlog))
			r.metrics.OldestPending.Set(oldest)
		}
		if depths, err := dlq.Stats(ctx, r.cfg.DB, r.cfg.Schema); err == nil {
			for source, d := range depths {
				r.metrics.DLQDepth.WithLabelValues(string(source)).Set(float64(d.Count))
				r.metrics.DLQAge.WithLabelValues(string(source)).Set(d.OldestAgeSeconds)
			}
			r.metrics.StatsTime.SetToCurrentTime()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
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

func (r *Relay) logDB(what string, err error) {
	if errors.Is(err, context.Canceled) {
		return
	}
	r.mu.Lock()
	first := !r.dbFailing
	r.dbFailing = true
	r.mu.Unlock()
	if first {
		r.log.Error("database unavailable; retrying every lease tick", "during", what, "error", err)
	}
}

func (r *Relay) dbOK() {
	r.mu.Lock()
	was := r.dbFailing
	r.dbFailing = false
	r.mu.Unlock()
	if was {
		r.log.Info("database reachable again")
	}
}
