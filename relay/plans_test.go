package relay_test

import (
	"context"
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
