package relay_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/relay"
)

// The relay's statements run with generic plans from their first execution on a connection (see
// genericPlans in sql.go): PostgreSQL would otherwise plan a statement anew for its first five
// executions, which for a shard's read costs milliseconds on every new connection. The relay
// runs on a pool of one connection, whose prepared statements say how they were planned.
func TestTheRelayPlansItsStatementsOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg, err := pgxpool.ParseConfig(b.env.URL)
	require.NoError(t, err)
	cfg.MaxConns = 1
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	for range 8 { // more transactions than PostgreSQL's five custom plans
		b.write(t, true, "k", 3)
	}
	b.startRelay(t, func(cfg *relay.Config) {
		cfg.DB, cfg.Shards, cfg.BatchSize = pool, 1, 3
	})
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 20*time.Millisecond)

	type plans struct {
		Statement       string
		Generic, Custom int64
	}
	// The relay's connection is the pool's only one; this query waits for it between the relay's
	// transactions. It goes in the simple protocol, so that it is not a prepared statement itself.
	var stmts []plans
	require.Eventually(t, func() bool {
		rows, err := pool.Query(context.Background(), `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
			WHERE statement LIKE '%txbox_%' ORDER BY statement`, pgx.QueryExecModeSimpleProtocol)
		require.NoError(t, err)
		stmts, err = pgx.CollectRows(rows, pgx.RowToStructByPos[plans])
		require.NoError(t, err)
		for _, s := range stmts {
			if s.Generic+s.Custom > 5 {
				return true
			}
		}
		return false // The relay's looks for new rows run every PollInterval: wait for one that ran often.
	}, 30*time.Second, 50*time.Millisecond, "no statement of the relay ran more than five times: the test shows nothing")
	for _, s := range stmts {
		require.Zerof(t, s.Custom, "%d custom plans of %s", s.Custom, s.Statement)
	}
}

// boundsTracer records, for each batch the relay sends, whether it begins a transaction and the
// statement timeout its bounds set.
type boundsTracer struct {
	mu      sync.Mutex
	inTx    []string // statement timeouts of batches that begin a transaction
	outside []string // statement timeouts of reads (batches that begin a read-only transaction)
}

func (*boundsTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (*boundsTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData)     {}
func (*boundsTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (*boundsTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

func (t *boundsTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	queued := d.Batch.QueuedQueries
	for _, q := range queued {
		if !strings.Contains(q.SQL, "set_config('statement_timeout'") {
			continue
		}
		t.mu.Lock()
		if beginsTransaction(d.Batch) {
			t.inTx = append(t.inTx, q.Arguments[1].(string))
		} else {
			t.outside = append(t.outside, q.Arguments[1].(string))
		}
		t.mu.Unlock()
	}
	return ctx
}

// A read (a read-only transaction of its own) holds no lock anyone waits for, and its first run on a connection
// includes planning it: ~300 ms for the 256 slots of a single shard on an idle server, more on a
// busy one, which is the shortest lease TTL allowed. Were reads bounded by the TTL, as statements
// in the relay's transactions are, a read cut short would be planned again at its next attempt and
// the shard could stall for good. Reads get at least 10 s; transactions keep the TTL.
func TestReadsAreNotCutShortByAShortLeaseTTL(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tracer := &boundsTracer{}
	cfg, err := pgxpool.ParseConfig(b.env.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	uuids := b.write(t, true, "k", 3)
	b.startRelay(t, func(cfg *relay.Config) {
		cfg.DB, cfg.Shards, cfg.LeaseTTL = pool, 1, 300*time.Millisecond
	})
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 20*time.Millisecond, "%d rows published", len(uuids))

	tracer.mu.Lock()
	defer tracer.mu.Unlock()
	require.NotEmpty(t, tracer.outside, "the relay read in read-only transactions")
	require.NotEmpty(t, tracer.inTx, "the relay ran transactions")
	for _, ms := range tracer.outside {
		require.Equal(t, "10000", ms, "a read's statement timeout")
	}
	for _, ms := range tracer.inTx {
		require.Equal(t, "300", ms, "a transaction's statement timeout: the lease TTL")
	}
}
