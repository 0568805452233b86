package bench

import (
	"context"
	"fmt"
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
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
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
)

// soakTables are the tables whose growth the soak watches: what every message passes through.
var soakTables = []string{"txbox_outbox", "txbox_inbox", "txbox_inbox_attempt"}

// TestSoak runs the whole pipeline (outbox writes → relay → Kafka → Watermill router behind the
// inbox, writing a business row) for TXBOX_SOAK_DURATION at TXBOX_SOAK_RATE messages per second,
// by default 70 % of the maximum measured by a short burst first, and logs per interval the
// throughput, the outbox backlog, the size of the tables and indexes every message passes
// through, and their dead tuples. It asserts only what does not depend on the clock: every message
// written is processed exactly once and the pipeline drains once the writers stop; the rates,
// their drift and the sizes are reported, never asserted.
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

	p := startSoakPipeline(t)
	var autovacuum string
	if err := p.app.QueryRow(context.Background(), "SHOW autovacuum").Scan(&autovacuum); err != nil {
		t.Fatal(err)
	}
	t.Logf("PostgreSQL autovacuum: %s", autovacuum)
	if autovacuum != "on" {
		t.Log("autovacuum is off on this server: only page pruning reclaims dead tuples and nothing removes their index entries, so sizes grow here that autovacuum would keep bounded; judge boundedness against a server with it on (TXBOX_TEST_DATABASE_URL)")
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

	t.Logf("soak: %s at %.0f msgs/s, %d writers, %d messages per transaction, a sample every %s", duration, rate, soakWriters, soakPerTx, interval)
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
	for i := 1; time.Duration(i)*interval <= duration; i++ {
		time.Sleep(time.Until(began.Add(time.Duration(i) * interval)))
		samples = append(samples, p.sample(t, time.Since(began)))
	}
	stopWriters()
	done.Wait()
	p.drain(t, max(soakDrainTimeout, duration))
	drained := p.sample(t, time.Since(began))
	logSoak(t, samples, drained)

	if drained.backlog != 0 {
		t.Errorf("outbox backlog after the drain: %d rows, want 0", drained.backlog)
	}
	var rows, distinct int64
	if err := p.app.QueryRow(context.Background(), "SELECT count(*), count(DISTINCT uuid) FROM "+p.env.Q("soak_effect")).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if written := p.written.Load(); rows != written || distinct != written {
		t.Errorf("business rows: %d (%d distinct messages), want one per message written: %d", rows, distinct, written)
	}
}

// soakPipeline is an application writing to the outbox and consuming through the inbox, with its
// own connection pool, and a relay with the pool of a separate process.
type soakPipeline struct {
	env      *txtest.Env
	app      *pgxpool.Pool
	writer   *outbox.Writer
	topic    string
	seq      atomic.Int64 // numbers messages, for their payload and partition key
	written  atomic.Int64 // messages in committed transactions
	consumed atomic.Int64 // messages the handler processed (and the inbox committed)
}

func startSoakPipeline(t *testing.T) *soakPipeline {
	ctx := context.Background()
	env := txtest.New(t)
	cfg, err := pgxpool.ParseConfig(env.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	cfg.MaxConns = 16
	app, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	// No unique key: a message processed twice shows as two rows instead of failing its handler.
	if _, err := app.Exec(ctx, "CREATE TABLE "+env.Q("soak_effect")+" (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, uuid text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	if err != nil {
		t.Fatal(err)
	}
	p := &soakPipeline{env: env, app: app, writer: w, topic: kafkatest.Topic(t)}

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
			if err == nil {
				p.consumed.Add(1)
			}
			return out, err
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
				for i := range msgs {
					n := int(p.seq.Add(1))
					msgs[i] = message.NewMessage(watermill.NewUUID(), payload(n))
					// Many keys, like events of many orders, so messages spread over every shard.
					outbox.SetPartitionKey(msgs[i], fmt.Sprintf("order-%d", n%1000))
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
			}
		})
	}
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

// drain waits until every message written has been processed and the outbox is empty.
func (p *soakPipeline) drain(t *testing.T, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for {
		var rows, backlog int64
		err := p.app.QueryRow(context.Background(), "SELECT (SELECT count(*) FROM "+p.env.Q("soak_effect")+"), (SELECT count(*) FROM "+p.env.Q("txbox_outbox")+")").Scan(&rows, &backlog)
		if err != nil {
			t.Fatal(err)
		}
		if backlog == 0 && rows >= p.written.Load() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not drained after %s: %d rows in the outbox, %d of %d messages processed", timeout, backlog, rows, p.written.Load())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type soakSample struct {
	at                time.Duration
	written, consumed int64
	backlog           int64
	tables            []tableStats // per soakTables
}

type tableStats struct {
	total, indexes int64 // bytes: pg_total_relation_size, pg_indexes_size
	dead, live     int64
}

// sample reads the counters and, summed over every partition, the size and tuple counts of
// soakTables.
func (p *soakPipeline) sample(t *testing.T, at time.Duration) soakSample {
	ctx := context.Background()
	// Read one after the other while messages flow, so the lag derived from them is off by
	// the few messages that moved in between, either way.
	s := soakSample{at: at, consumed: p.consumed.Load(), written: p.written.Load()}
	if err := p.app.QueryRow(ctx, "SELECT count(*) FROM "+p.env.Q("txbox_outbox")).Scan(&s.backlog); err != nil {
		t.Fatal(err)
	}
	for _, table := range soakTables {
		var ts tableStats
		// pg_partition_tree lists nothing for a table that is not partitioned.
		err := p.app.QueryRow(ctx, `WITH root AS (SELECT $1::text::regclass AS relid),
			leaves AS (
				SELECT t.relid FROM root, pg_partition_tree(root.relid) AS t WHERE t.isleaf
				UNION
				SELECT c.oid::regclass FROM root JOIN pg_class AS c ON c.oid = root.relid WHERE c.relkind = 'r')
			SELECT coalesce(sum(pg_total_relation_size(l.relid)), 0)::bigint,
				coalesce(sum(pg_indexes_size(l.relid)), 0)::bigint,
				coalesce(sum(s.n_dead_tup), 0)::bigint, coalesce(sum(s.n_live_tup), 0)::bigint
			FROM leaves AS l LEFT JOIN pg_stat_user_tables AS s ON s.relid = l.relid`, p.env.Q(table)).Scan(&ts.total, &ts.indexes, &ts.dead, &ts.live)
		if err != nil {
			t.Fatalf("sizes of %s: %v", table, err)
		}
		s.tables = append(s.tables, ts)
	}
	return s
}

// logSoak logs the samples as a Markdown table, then the drift of the consumed rate (the last
// interval against the first) and the largest sizes.
func logSoak(t *testing.T, samples []soakSample, drained soakSample) {
	var sb strings.Builder
	sb.WriteString("\n| t | written/s | published/s | consumed/s | backlog | lag |")
	for _, table := range soakTables {
		fmt.Fprintf(&sb, " %s size (idx) | dead / live |", table)
	}
	sb.WriteString("\n|---|---|---|---|---|---|" + strings.Repeat("---|---|", len(soakTables)) + "\n")
	row := func(label string, s soakSample, rates string) {
		// Lag: published to Kafka, not yet processed.
		fmt.Fprintf(&sb, "| %s | %s %d | %d |", label, rates, s.backlog, s.written-s.backlog-s.consumed)
		for _, ts := range s.tables {
			fmt.Fprintf(&sb, " %s (%s) | %d / %d |", size(ts.total), size(ts.indexes), ts.dead, ts.live)
		}
		sb.WriteString("\n")
	}
	consumedRate := make([]float64, len(samples))
	for i, s := range samples {
		rates := "| | |"
		if i > 0 {
			prev := samples[i-1]
			secs := (s.at - prev.at).Seconds()
			// Published rows are deleted, so what left the outbox is what was written less the
			// backlog's growth.
			published := (s.written - prev.written) - (s.backlog - prev.backlog)
			consumedRate[i] = float64(s.consumed-prev.consumed) / secs
			rates = fmt.Sprintf("%.0f | %.0f | %.0f |", float64(s.written-prev.written)/secs, float64(published)/secs, consumedRate[i])
		}
		row(s.at.Round(time.Second).String(), s, rates)
	}
	row("drained", drained, "| | |")
	t.Log(sb.String())

	if n := len(consumedRate); n > 2 {
		t.Logf("throughput drift (consumed/s, last interval against the first): %+.1f %%", 100*(consumedRate[n-1]/consumedRate[1]-1))
	}
	for i, table := range soakTables {
		var biggest tableStats
		for _, s := range append(samples, drained) {
			biggest.total = max(biggest.total, s.tables[i].total)
			biggest.indexes = max(biggest.indexes, s.tables[i].indexes)
			biggest.dead = max(biggest.dead, s.tables[i].dead)
		}
		t.Logf("max %s: %s, indexes %s, %d dead tuples", table, size(biggest.total), size(biggest.indexes), biggest.dead)
	}
}

func size(bytes int64) string {
	if bytes < 1<<20 {
		return fmt.Sprintf("%d kB", bytes>>10)
	}
	return fmt.Sprintf("%.1f MiB", float64(bytes)/(1<<20))
}
