package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/retention"
)

// Soak settings. The writers are a few application goroutines writing small transactions, as a
// service under load does.
const (
	soakWriters = 4
	soakPerTx   = 5
	// soakBurst is how long the unthrottled burst that finds the maximum rate lasts; its first
	// soakBurstWarmup is not counted (the consumer group joins, the shards' producers open).
	soakBurst       = 20 * time.Second
	soakBurstWarmup = 5 * time.Second
	// soakAhead is how far the burst's writers may get ahead of the consumer: they then wait, so
	// the burst measures the pipeline's rate instead of building a backlog to drain.
	soakAhead = 5000
	// soakShare of the maximum is the soak's rate.
	soakShare = 0.7
	// soakDrainTimeout bounds the wait for the pipeline to empty once the writers stop (at least;
	// a long soak waits as long as it ran).
	soakDrainTimeout = 5 * time.Minute
	// soakCopyEvery: for every this many messages written, one message written earlier (within
	// the broker's retention) is sent again, as a broker's redelivery would, so that the
	// exactly-once check meets duplicates whose first copy is in an older inbox generation.
	soakCopyEvery = 100
	// soakCopyMetadata marks a copy, with its number: the inbox deduplicates by UUID, so the copy
	// is the same message to it.
	soakCopyMetadata = "soak_copy"
	// soakMinGeneration keeps a short soak's generations long against what a rotation may take
	// (retention.DefaultGenerationLockTimeout and its DDL), on which maxGenerations relies.
	soakMinGeneration = 10 * time.Second
)

// soakTables are the tables whose growth the soak watches: what every message passes through.
var soakTables = []string{"txbox_outbox", "txbox_inbox", "txbox_inbox_attempt"}

// soakRetention is production's retention scaled to a soak of duration d: a generation is d/10
// (a minute of a 10-minute soak), the inbox remembers two generations (d/5) and the broker
// redelivers for one. So a 10-minute soak has filled its inbox after about 3.5 minutes
// (warmUp) and then rotates and drops a generation every minute, six times: enough to show a
// plateau, while every delivery probes the 3 to 4 generations alive, against 16 to 17 with
// production's defaults (a day, 15 days). Passes come every quarter generation (production's
// default is a 24th: hourly for daily generations): often enough that a generation runs at most
// a quarter past its length, rarely enough that passes stay a small part of the load.
type soakRetention struct {
	generation, inbox, broker, every time.Duration
}

func soakRetentionFor(d time.Duration) soakRetention {
	g := max(d/10, soakMinGeneration)
	return soakRetention{generation: g, inbox: 2 * g, broker: g, every: g / 4}
}

// maxGenerations is the most generations a retention pass leaves. Rotations start generations at
// least a generation apart by the database's clock, and a pass drops every generation but the
// current one whose newest row is older than the inbox retention, that is, every one whose
// successor started before the pass's cutoff (give or take the moment a rotation waits for the
// deliveries in flight, far shorter than a generation). After a pass, the generations that
// started in the retention window, at most inbox/generation+1, are alive, with the one before
// them. A pass that fails or is late leaves no more: it is also the one that rotates.
func (r soakRetention) maxGenerations() int64 { return int64(r.inbox/r.generation) + 2 }

// warmUp is when the inbox has filled: a generation of the soak's rows has been dropped.
func (r soakRetention) warmUp() time.Duration { return r.inbox + r.generation + 2*r.every }

// TestSoak runs the whole pipeline (outbox writes → relay → Kafka → Watermill router behind the
// inbox, writing a business row) for TXBOX_SOAK_DURATION at TXBOX_SOAK_RATE messages per second,
// by default 70 % of the maximum measured by a short burst first, with the retention Cleaner
// running as in production (soakRetention), and logs per interval the throughput, the outbox
// backlog, the inbox's generations, the size of the tables and indexes every message passes
// through, and their dead tuples; at the end each table's and index's size after warm-up and at
// the end. On a server without autovacuum it vacuums as autovacuum would (vacuum).
//
// It asserts only what does not depend on the clock: every message written is processed exactly
// once, although one in soakCopyEvery is sent again, the pipeline drains once the writers stop,
// and no retention pass leaves more inbox generations than maxGenerations. The rates, their drift
// and the sizes are reported, never asserted.
func TestSoak(t *testing.T) {
	if os.Getenv("TXBOX_SOAK") != "1" {
		t.Skip("soak: set TXBOX_SOAK=1 to run it (TXBOX_SOAK_DURATION, default 10m; TXBOX_SOAK_RATE, messages/s, default 70 % of the measured maximum)")
	}
	duration := 10 * time.Minute
	if v := os.Getenv("TXBOX_SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("TXBOX_SOAK_DURATION=%q: want a positive duration", v)
		}
		duration = d
	}
	var rate float64
	if v := os.Getenv("TXBOX_SOAK_RATE"); v != "" {
		r, err := strconv.ParseFloat(v, 64)
		if err != nil || r <= 0 {
			t.Fatalf("TXBOX_SOAK_RATE=%q: want a positive number of messages per second", v)
		}
		rate = r
	}
	interval := min(time.Minute, duration/10)
	ret := soakRetentionFor(duration)

	p := startSoakPipeline(t)
	var autovacuum string
	if err := p.app.QueryRow(context.Background(), "SHOW autovacuum").Scan(&autovacuum); err != nil {
		t.Fatal(err)
	}
	t.Logf("retention: a generation every %s, inbox retention %s, broker retention %s (the age of the copies sent again), a pass every %s; at most %d generations after a pass",
		ret.generation, ret.inbox, ret.broker, ret.every, ret.maxGenerations())
	stopRetention := p.retain(t, ret)
	stopVacuum := func() soakVacuumStats { return soakVacuumStats{} }
	if autovacuum == "on" {
		t.Log("PostgreSQL autovacuum: on; the soak leaves vacuuming to it")
	} else {
		t.Logf("PostgreSQL autovacuum: %s. Without it only page pruning reclaims the rows the relay, the inbox and retention delete, and nothing removes their index entries, "+
			"so the soak does what autovacuum would: VACUUM every txbox table of its schema every %s (autovacuum's default naptime is 1 min)", autovacuum, interval)
		stopVacuum = p.vacuum(t, interval)
	}

	// Nothing is timed until the consumer group has joined and the shards' producers are open.
	p.write(context.Background(), t, func(context.Context) func() bool {
		turns := 0
		return func() bool { turns++; return turns == 1 }
	}).Wait()
	p.drain(t, soakDrainTimeout)

	if rate == 0 {
		maxRate := p.burst(t)
		rate = soakShare * maxRate
		t.Logf("maximum (unthrottled burst, %s counted): %.0f msgs/s; soak rate %.0f %%: %.0f msgs/s", soakBurst-soakBurstWarmup, maxRate, 100*soakShare, rate)
		p.drain(t, soakDrainTimeout)
	}

	t.Logf("soak: %s at %.0f msgs/s, %d writers, %d messages per transaction, a sample every %s; one message in %d sent again, up to %s after it was written",
		duration, rate, soakWriters, soakPerTx, interval, soakCopyEvery, ret.broker)
	ctx, stopWriters := context.WithCancel(context.Background())
	gap := time.Duration(float64(time.Second) * soakPerTx * soakWriters / rate)
	began := time.Now()
	samples := []soakSample{p.sample(t, 0)}
	done := p.write(ctx, t, func(ctx context.Context) func() bool {
		tick := time.NewTicker(gap)
		return func() bool {
			select {
			case <-ctx.Done():
				tick.Stop()
				return false
			case <-tick.C:
				return true
			}
		}
	})
	copying := p.sendCopies(ctx, t, time.Duration(float64(time.Second)*soakCopyEvery/rate), ret.broker)
	for i := 1; time.Duration(i)*interval <= duration; i++ {
		time.Sleep(time.Until(began.Add(time.Duration(i) * interval)))
		samples = append(samples, p.sample(t, time.Since(began)))
	}
	stopWriters()
	done.Wait()
	copying.Wait()
	p.drain(t, max(soakDrainTimeout, duration))
	drained := p.sample(t, time.Since(began))
	retained := stopRetention()
	vacuumed := stopVacuum()
	warm := warmedUp(samples, ret.warmUp())
	logSoak(t, samples, drained, warm)
	logSizes(t, samples, warm, ret.warmUp())
	t.Logf("retention: %d passes (%d failed), %d rotations (%d deferred by deliveries in flight), %d generations dropped whole, "+
		"%d inbox rows deleted one by one (past the cutoff in the current generation), at most %d generations after a pass (bound %d)",
		retained.passes, retained.failed, retained.rotations, retained.deferred, retained.dropped, retained.deletedOneByOne, retained.maxGenerations, ret.maxGenerations())
	if vacuumed.rounds > 0 {
		t.Logf("VACUUM: %d rounds over the txbox tables, the longest %s; the oldest transaction open in the database when a round began was %s old "+
			"(VACUUM keeps the rows deleted since it started: on a shared server, other sessions' long transactions hold sizes up)",
			vacuumed.rounds, vacuumed.longest.Round(time.Millisecond), vacuumed.oldestSnapshot.Round(time.Second))
	}

	if drained.backlog != 0 {
		t.Errorf("outbox backlog after the drain: %d rows, want 0", drained.backlog)
	}
	var rows, distinct int64
	if err := p.app.QueryRow(context.Background(), "SELECT count(*), count(DISTINCT uuid) FROM "+p.env.Q("soak_effect")).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	t.Logf("copies: %d sent, each delivered and dropped as a duplicate unless counted below; %d messages processed more than once", p.copies.Load(), rows-distinct)
	if written := p.written.Load(); rows != written || distinct != written {
		t.Errorf("business rows: %d (%d distinct messages), want one per message written: %d (and none for the %d copies sent again)", rows, distinct, written, p.copies.Load())
	}
	if retained.maxGenerations > ret.maxGenerations() {
		t.Errorf("a retention pass left %d inbox generations, want at most %d (inbox retention / generation + 2)", retained.maxGenerations, ret.maxGenerations())
	}
}

// soakPipeline is an application writing to the outbox and consuming through the inbox, with its
// own connection pool, a relay with the pool of a separate process, and operations (retention,
// VACUUM) with a pool of their own, as `txbox retention` has.
type soakPipeline struct {
	env      *txtest.Env
	app, ops *pgxpool.Pool
	writer   *outbox.Writer
	topic    string
	seq      atomic.Int64 // numbers messages, for their payload and partition key
	written  atomic.Int64 // messages in committed transactions
	consumed atomic.Int64 // messages the handler processed (and the inbox committed)

	// recent are messages written within the broker's retention, oldest first, which copy sends
	// again (sendCopies): one per transaction.
	recentMu sync.Mutex
	recent   []soakWritten
	copies   atomic.Int64 // copies in committed transactions
	// copiesDelivered counts deliveries of copies; copiesAcked holds the numbers of the copies
	// acknowledged, which a redelivery does not count twice.
	copiesDelivered atomic.Int64
	copiesMu        sync.Mutex
	copiesAcked     map[string]struct{}
}

type soakWritten struct {
	uuid string
	n    int
	at   time.Time
}

func startSoakPipeline(t *testing.T) *soakPipeline {
	ctx := context.Background()
	env := txtest.New(t)
	pool := func(conns int32) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(env.URL)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["search_path"] = ""
		cfg.MaxConns = conns
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	app := pool(16)
	// No unique key: a message processed twice shows as two rows instead of failing its handler.
	if _, err := app.Exec(ctx, "CREATE TABLE "+env.Q("soak_effect")+" (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, uuid text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	if err != nil {
		t.Fatal(err)
	}
	p := &soakPipeline{env: env, app: app, ops: pool(2), writer: w, topic: kafkatest.Topic(t), copiesAcked: map[string]struct{}{}}

	ib, err := inbox.New(inbox.Config{DB: app, Consumer: "soak", Schema: env.Schema, Delivery: kafkasub.Delivery}, nil)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	// The first middleware is the outermost: a message counts once the inbox has committed it.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := h(m)
			if err != nil {
				return out, err
			}
			if c := m.Metadata.Get(soakCopyMetadata); c != "" {
				p.copiesDelivered.Add(1)
				p.copiesMu.Lock()
				p.copiesAcked[c] = struct{}{}
				p.copiesMu.Unlock()
			} else {
				p.consumed.Add(1)
			}
			return out, nil
		}
	}, ib.Middleware)
	router.AddConsumerHandler("soak", p.topic, kafkatest.NewSubscriber(t, "soak-"+env.Schema), func(m *message.Message) error {
		tx, _ := inbox.TxFromContext(m.Context())
		_, err := tx.Exec(m.Context(), "INSERT INTO "+env.Q("soak_effect")+" (uuid) VALUES ($1)", m.UUID)
		return err
	})
	txtest.RunRouter(t, router)

	_, stop := startRelay(t, env, kafkaSink(t, env, true))
	t.Cleanup(stop)
	return p
}

// write runs soakWriters goroutines, each writing a transaction of soakPerTx messages whenever
// its function from pace returns true, and stopping when it returns false.
func (p *soakPipeline) write(ctx context.Context, t *testing.T, pace func(context.Context) func() bool) *sync.WaitGroup {
	var wg sync.WaitGroup
	for range soakWriters {
		next := pace(ctx)
		wg.Go(func() {
			for next() {
				msgs := make([]*message.Message, soakPerTx)
				var first int
				for i := range msgs {
					n := int(p.seq.Add(1))
					if i == 0 {
						first = n
					}
					msgs[i] = soakMessage(watermill.NewUUID(), n)
				}
				// Not ctx: a transaction cancelled during its commit may have committed, and the
				// count of messages written must be exact.
				err := pgx.BeginFunc(context.Background(), p.app, func(tx pgx.Tx) error {
					return p.writer.Publish(context.Background(), tx, p.topic, msgs...)
				})
				if err != nil {
					t.Errorf("writer: %v", err)
					return
				}
				p.written.Add(soakPerTx)
				p.recentMu.Lock()
				p.recent = append(p.recent, soakWritten{uuid: msgs[0].UUID, n: first, at: time.Now()})
				p.recentMu.Unlock()
			}
		})
	}
	return &wg
}

// soakMessage is the n-th message. Many keys, like events of many orders, so messages spread over
// every shard; its copies have its key, so they follow it.
func soakMessage(uuid string, n int) *message.Message {
	m := message.NewMessage(uuid, payload(n))
	outbox.SetPartitionKey(m, fmt.Sprintf("order-%d", n%1000))
	return m
}

// sendCopies sends, every gap until ctx ends, a copy of a message written within the last window,
// picked at random, in a transaction of its own.
func (p *soakPipeline) sendCopies(ctx context.Context, t *testing.T, gap, window time.Duration) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Go(func() {
		every(ctx, gap, func() bool {
			p.recentMu.Lock()
			from := time.Now().Add(-window)
			old := 0
			for old < len(p.recent) && p.recent[old].at.Before(from) {
				old++
			}
			p.recent = p.recent[old:]
			if len(p.recent) == 0 {
				p.recentMu.Unlock()
				return true
			}
			orig := p.recent[rand.IntN(len(p.recent))]
			p.recentMu.Unlock()

			m := soakMessage(orig.uuid, orig.n)
			m.Metadata.Set(soakCopyMetadata, strconv.FormatInt(p.copies.Load()+1, 10))
			err := pgx.BeginFunc(context.Background(), p.app, func(tx pgx.Tx) error {
				return p.writer.Publish(context.Background(), tx, p.topic, m)
			})
			if err != nil {
				t.Errorf("copy: %v", err)
				return false
			}
			p.copies.Add(1)
			return true
		})
	})
	return &wg
}

// burst writes as fast as the writers can, up to soakAhead messages ahead of the consumer, and
// returns the rate at which messages were consumed after soakBurstWarmup.
func (p *soakPipeline) burst(t *testing.T) float64 {
	ctx, stop := context.WithTimeout(context.Background(), soakBurst)
	defer stop()
	done := p.write(ctx, t, func(ctx context.Context) func() bool {
		return func() bool {
			for p.written.Load()-p.consumed.Load() > soakAhead {
				if ctx.Err() != nil {
					return false
				}
				time.Sleep(time.Millisecond)
			}
			return ctx.Err() == nil
		}
	})
	time.Sleep(soakBurstWarmup)
	from, at := p.consumed.Load(), time.Now()
	<-ctx.Done()
	rate := float64(p.consumed.Load()-from) / time.Since(at).Seconds()
	done.Wait()
	return rate
}

// drain waits until every message written has been processed, every copy acknowledged and the
// outbox is empty.
func (p *soakPipeline) drain(t *testing.T, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for {
		var rows, backlog int64
		err := p.app.QueryRow(context.Background(), "SELECT (SELECT count(*) FROM "+p.env.Q("soak_effect")+"), (SELECT count(*) FROM "+p.env.Q("txbox_outbox")+")").Scan(&rows, &backlog)
		if err != nil {
			t.Fatal(err)
		}
		p.copiesMu.Lock()
		acked := int64(len(p.copiesAcked))
		p.copiesMu.Unlock()
		if backlog == 0 && rows >= p.written.Load() && acked >= p.copies.Load() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not drained after %s: %d rows in the outbox, %d of %d messages processed, %d of %d copies acknowledged",
				timeout, backlog, rows, p.written.Load(), acked, p.copies.Load())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type soakRetentionStats struct {
	passes, failed, rotations, deferred, dropped int
	deletedOneByOne                              int64 // Report.DoneDeleted and DeadDeleted
	maxGenerations                               int64 // generation tables after a pass
}

// retain runs the retention Cleaner as `txbox retention --every` does (Cleaner.Run: a pass at
// once, then one every Interval), but calls its passes itself, to count the inbox's generations
// after each. stop ends it and returns what the passes did.
func (p *soakPipeline) retain(t *testing.T, r soakRetention) (stop func() soakRetentionStats) {
	c, err := retention.New(retention.Config{
		DB: p.ops, Schema: p.env.Schema, BrokerRetention: r.broker, InboxRetention: r.inbox,
		InboxGeneration: r.generation, Interval: r.every, Logger: quietLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var stats soakRetentionStats
	done := make(chan struct{})
	go func() {
		defer close(done)
		pass := func() bool {
			rep, err := c.RunOnce(ctx)
			if ctx.Err() != nil {
				return false
			}
			stats.passes++
			if err != nil {
				stats.failed++ // logged by the Cleaner
			}
			if rep.Rotated {
				stats.rotations++
			}
			if rep.RotationDeferred {
				stats.deferred++
			}
			stats.dropped += len(rep.GenerationsDropped)
			stats.deletedOneByOne += rep.DoneDeleted + rep.DeadDeleted
			n, err := p.generations(ctx)
			if err != nil {
				if ctx.Err() == nil {
					t.Errorf("count the inbox generations: %v", err)
				}
				return false
			}
			stats.maxGenerations = max(stats.maxGenerations, n)
			return true
		}
		if pass() {
			every(ctx, r.every, pass)
		}
	}()
	stop = sync.OnceValue(func() soakRetentionStats {
		cancel()
		<-done
		return stats
	})
	t.Cleanup(func() { stop() })
	return stop
}

// generations counts the inbox's generations: its partitions, with any detached and not yet dropped.
func (p *soakPipeline) generations(ctx context.Context) (int64, error) {
	var n int64
	err := p.ops.QueryRow(ctx, `SELECT count(*) FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relkind = 'r' AND c.relname ~ '^txbox_inbox_g[0-9]+$'`, p.env.Schema).Scan(&n)
	return n, err
}

type soakVacuumStats struct {
	rounds  int
	longest time.Duration
	// oldestSnapshot is the age of the oldest snapshot another session of the database held
	// when a round began: VACUUM cannot remove a row deleted after it was taken.
	oldestSnapshot time.Duration
}

// vacuum does, every interval, what autovacuum would on a server where it is on: VACUUM each
// table of txbox's (each partition of the inbox on its own, as autovacuum does, so that it never
// locks the partitioned table, which a rotation's ATTACH needs). SKIP_LOCKED leaves a generation
// being detached to its drop. stop ends it and returns what it did.
func (p *soakPipeline) vacuum(t *testing.T, interval time.Duration) (stop func() soakVacuumStats) {
	ctx, cancel := context.WithCancel(context.Background())
	var stats soakVacuumStats
	done := make(chan struct{})
	go func() {
		defer close(done)
		every(ctx, interval, func() bool {
			start := time.Now()
			var oldest time.Duration
			err := p.ops.QueryRow(ctx, `SELECT coalesce(max(now() - xact_start), '0') FROM pg_stat_activity
				WHERE datname = current_database() AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) AND pid <> pg_backend_pid()`).Scan(&oldest)
			if err == nil {
				err = p.vacuumOnce(ctx)
			}
			if err != nil {
				if ctx.Err() == nil {
					t.Errorf("vacuum: %v", err)
				}
				return false
			}
			stats.rounds++
			stats.longest = max(stats.longest, time.Since(start))
			stats.oldestSnapshot = max(stats.oldestSnapshot, oldest)
			return true
		})
	}()
	stop = sync.OnceValue(func() soakVacuumStats {
		cancel()
		<-done
		return stats
	})
	t.Cleanup(func() { stop() })
	return stop
}

func (p *soakPipeline) vacuumOnce(ctx context.Context) error {
	rows, err := p.ops.Query(ctx, `SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relkind = 'r' AND c.relname LIKE 'txbox%' ORDER BY c.relname`, p.env.Schema)
	if err != nil {
		return err
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, table := range tables {
		var pgErr *pgconn.PgError
		if _, err := p.ops.Exec(ctx, "VACUUM (SKIP_LOCKED) "+table); err != nil && !(errors.As(err, &pgErr) && pgErr.Code == "42P01") { // undefined_table: a generation dropped meanwhile
			return fmt.Errorf("%s: %w", table, err)
		}
	}
	return nil
}

type soakSample struct {
	at                time.Duration
	written, consumed int64
	copies, delivered int64 // copies written, deliveries of copies
	backlog           int64
	generations       int64
	tables            []tableStats // per soakTables
}

type tableStats struct {
	// rels are the table (pg_table_size: its heap and TOAST) and then each of its indexes, each
	// summed over the partitions.
	rels       []relSize
	dead, live int64
}

type relSize struct {
	name  string
	bytes int64
}

func (ts tableStats) total() int64 {
	var n int64
	for _, r := range ts.rels {
		n += r.bytes
	}
	return n
}

// sample reads the counters, the inbox's generations and, summed over every partition, the size
// and tuple counts of soakTables and the sizes of their indexes.
func (p *soakPipeline) sample(t *testing.T, at time.Duration) soakSample {
	ctx := context.Background()
	// Read one after the other while messages flow, so the lag derived from them is off by
	// the few messages that moved in between, either way.
	s := soakSample{at: at, consumed: p.consumed.Load(), written: p.written.Load(), copies: p.copies.Load(), delivered: p.copiesDelivered.Load()}
	if err := p.app.QueryRow(ctx, "SELECT count(*) FROM "+p.env.Q("txbox_outbox")).Scan(&s.backlog); err != nil {
		t.Fatal(err)
	}
	var err error
	if s.generations, err = p.generations(ctx); err != nil {
		t.Fatal(err)
	}
	for _, table := range soakTables {
		var ts tableStats
		// pg_partition_tree lists a partitioned table or index with its partitions, and nothing
		// for one that is not partitioned; a partitioned one has no storage of its own.
		rows, err := p.app.Query(ctx, `WITH rels AS (
				SELECT c.oid, c.relname, c.relkind FROM pg_class AS c WHERE c.oid = $1::text::regclass
				UNION ALL
				SELECT c.oid, c.relname, c.relkind FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid WHERE i.indrelid = $1::text::regclass)
			SELECT r.relname, (SELECT coalesce(sum(CASE WHEN r.relkind IN ('r', 'p') THEN pg_table_size(l.relid) ELSE pg_relation_size(l.relid) END), 0)::bigint
				FROM (SELECT t.relid FROM pg_partition_tree(r.oid) AS t UNION SELECT r.oid) AS l)
			FROM rels AS r ORDER BY r.relkind IN ('r', 'p') DESC, r.relname`, p.env.Q(table))
		if err != nil {
			t.Fatalf("sizes of %s: %v", table, err)
		}
		ts.rels, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (relSize, error) {
			var rs relSize
			return rs, r.Scan(&rs.name, &rs.bytes)
		})
		if err != nil {
			t.Fatalf("sizes of %s: %v", table, err)
		}
		err = p.app.QueryRow(ctx, `SELECT coalesce(sum(s.n_dead_tup), 0)::bigint, coalesce(sum(s.n_live_tup), 0)::bigint
			FROM (SELECT t.relid FROM pg_partition_tree($1::text::regclass) AS t UNION SELECT $1::text::regclass) AS l
			JOIN pg_stat_user_tables AS s ON s.relid = l.relid`, p.env.Q(table)).Scan(&ts.dead, &ts.live)
		if err != nil {
			t.Fatalf("tuples of %s: %v", table, err)
		}
		s.tables = append(s.tables, ts)
	}
	return s
}

// warmedUp is the index of the first sample once the inbox has filled (warmUp), or len(samples).
func warmedUp(samples []soakSample, warmUp time.Duration) int {
	for i, s := range samples {
		if s.at >= warmUp {
			return i
		}
	}
	return len(samples)
}

// logSoak logs the samples as a Markdown table, then the drift of the consumed rate (the last
// interval against the first, and against the one that ends at samples[warm]: the first
// interval may be the consumer catching up) and the largest sizes.
func logSoak(t *testing.T, samples []soakSample, drained soakSample, warm int) {
	var sb strings.Builder
	sb.WriteString("\n| t | written/s | published/s | consumed/s | backlog | lag | inbox generations |")
	for _, table := range soakTables {
		fmt.Fprintf(&sb, " %s size (idx) | dead / live |", table)
	}
	sb.WriteString("\n|---|---|---|---|---|---|---|" + strings.Repeat("---|---|", len(soakTables)) + "\n")
	row := func(label string, s soakSample, rates string) {
		// Lag: published to Kafka, not yet processed; copies included.
		fmt.Fprintf(&sb, "| %s | %s %d | %d | %d |", label, rates, s.backlog, s.written+s.copies-s.backlog-s.consumed-s.delivered, s.generations)
		for _, ts := range s.tables {
			idx := ts.total() - ts.rels[0].bytes
			fmt.Fprintf(&sb, " %s (%s) | %d / %d |", size(ts.total()), size(idx), ts.dead, ts.live)
		}
		sb.WriteString("\n")
	}
	consumedRate := make([]float64, len(samples))
	for i, s := range samples {
		rates := "| | |"
		if i > 0 {
			prev := samples[i-1]
			secs := (s.at - prev.at).Seconds()
			// Published rows are deleted, so what left the outbox is what was written (copies too)
			// less the backlog's growth.
			published := (s.written + s.copies - prev.written - prev.copies) - (s.backlog - prev.backlog)
			consumedRate[i] = float64(s.consumed-prev.consumed) / secs
			rates = fmt.Sprintf("%.0f | %.0f | %.0f |", float64(s.written-prev.written)/secs, float64(published)/secs, consumedRate[i])
		}
		row(s.at.Round(time.Second).String(), s, rates)
	}
	row("drained", drained, "| | |")
	t.Log(sb.String())

	if n := len(consumedRate); n > 2 {
		t.Logf("throughput drift (consumed/s, last interval against the first): %+.1f %%", 100*(consumedRate[n-1]/consumedRate[1]-1))
		if warm < n-1 {
			t.Logf("throughput drift once warmed up (consumed/s, last interval against the one to %s): %+.1f %%",
				samples[warm].at.Round(time.Second), 100*(consumedRate[n-1]/consumedRate[warm]-1))
		}
	}
	for i, table := range soakTables {
		var biggest, dead int64
		for _, s := range append(samples, drained) {
			biggest = max(biggest, s.tables[i].total())
			dead = max(dead, s.tables[i].dead)
		}
		t.Logf("max %s: %s with its indexes, %d dead tuples", table, size(biggest), dead)
	}
}

// logSizes logs each table's and index's size at samples[first], once the inbox has filled
// (warmUp), and at the last sample while writing, and the growth in between.
func logSizes(t *testing.T, samples []soakSample, first int, warmUp time.Duration) {
	last := len(samples) - 1
	if first >= last {
		t.Logf("sizes: the soak ended before its inbox had filled (%s); run it longer to see whether they stay bounded", warmUp)
		return
	}
	from, to := samples[first], samples[last]
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n| relation | at %s (warmed up) | at %s | growth |\n|---|---:|---:|---:|\n", from.at.Round(time.Second), to.at.Round(time.Second))
	for i := range soakTables {
		// A relation is matched by its position: the tables' indexes do not change during a soak.
		for j, r := range to.tables[i].rels {
			before := from.tables[i].rels[j].bytes
			growth := "–"
			if before > 0 {
				growth = fmt.Sprintf("%+.0f %%", 100*(float64(r.bytes)/float64(before)-1))
			}
			fmt.Fprintf(&sb, "| %s | %s | %s | %s %s |\n", r.name, size(before), size(r.bytes), signedSize(r.bytes-before), growth)
		}
	}
	t.Log(sb.String())
}

func size(bytes int64) string {
	if bytes < 1<<20 {
		return fmt.Sprintf("%d kB", bytes>>10)
	}
	return fmt.Sprintf("%.1f MiB", float64(bytes)/(1<<20))
}

func signedSize(bytes int64) string {
	if bytes < 0 {
		return "−" + size(-bytes)
	}
	return "+" + size(bytes)
}

// every calls f every interval until ctx ends or f returns false.
func every(ctx context.Context, interval time.Duration, f func() bool) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if !f() {
			return
		}
	}
}
