package retention_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/retention"
)

// TestScale loads millions of inbox rows and logs what deliveries and retention cost at that size:
// the rate of fresh and duplicate deliveries as the inbox grows, then with many live generations,
// the pass that drops them, and, for comparison, deleting rows one by one. It asserts what must
// hold at any size, never how long anything took. The figures are in README (Retention).
//
//	TXBOX_SCALE=1 go test -run TestScale -v -timeout 1h ./retention/
func TestScale(t *testing.T) {
	if os.Getenv("TXBOX_SCALE") != "1" {
		t.Skip("loads millions of inbox rows for minutes: run with TXBOX_SCALE=1 (TXBOX_SCALE_ROWS sets the largest size, default 4000000)")
	}
	maxRows := 4_000_000
	if s := os.Getenv("TXBOX_SCALE_ROWS"); s != "" {
		var err error
		maxRows, err = strconv.Atoi(s)
		require.NoError(t, err, "TXBOX_SCALE_ROWS")
	}
	tb := setup(t)
	ctx := context.Background()
	// load adds rows n rows to the current generation, received ago.
	load := func(prefix string, n int, ago time.Duration) time.Duration {
		start := time.Now()
		tb.exec(t, `INSERT INTO `+tb.env.Q("txbox_inbox")+` (consumer, dedup_key, message_uuid, topic, received_at)
			SELECT 'billing', $1 || g, $1 || g, 'orders', now() - $2 * interval '1 second' FROM generate_series(1, $3) AS g`,
			prefix, ago.Seconds(), n)
		tb.exec(t, `ANALYZE `+tb.env.Q("txbox_inbox"))
		return time.Since(start)
	}
	c := tb.consumer(t, inbox.Config{})
	batch := 0
	// deliver delivers keys with 8 workers and returns their rate.
	deliver := func(keys []string) float64 {
		start := time.Now()
		var wg sync.WaitGroup
		work := make(chan string)
		for range 8 {
			wg.Go(func() {
				for k := range work {
					require.NoError(t, c.deliver(k))
				}
			})
		}
		for _, k := range keys {
			work <- k
		}
		close(work)
		wg.Wait()
		return float64(len(keys)) / time.Since(start).Seconds()
	}
	const probe = 2000
	// rates measures fresh deliveries, then duplicates of rows prefix-1 to prefix-probe.
	rates := func(what, prefix string) {
		batch++
		fresh := make([]string, probe)
		for i := range fresh {
			fresh[i] = fmt.Sprintf("fresh-%d-%d", batch, i)
		}
		freshRate := deliver(fresh)
		dups := make([]string, probe)
		for i := range dups {
			dups[i] = fmt.Sprintf("%s%d", prefix, i+1)
		}
		dupRate := deliver(dups)
		for _, k := range dups {
			require.Zero(t, c.runs(k), "a duplicate was processed")
		}
		var rows, bytes int64
		require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+tb.env.Q("txbox_inbox")+`),
			(SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree($1::regclass))`, tb.env.Q("txbox_inbox")).Scan(&rows, &bytes))
		t.Logf("%s: %d rows, %d MiB, %d generation(s): fresh %.0f msg/s, duplicates %.0f msg/s",
			what, rows, bytes>>20, len(tb.partitions(t)), freshRate, dupRate)
	}

	loaded := 0
	for _, size := range []int{maxRows / 4, maxRows / 2, maxRows} {
		took := load(fmt.Sprintf("g0-%d-", size), size-loaded, 20*day)
		t.Logf("loaded %d rows in %s", size-loaded, took.Round(time.Millisecond))
		rates(fmt.Sprintf("one generation of %d rows", size), fmt.Sprintf("g0-%d-", maxRows/4))
		loaded = size
	}

	// Sixteen more generations, fifteen of maxRows/16 rows each and the current one: a delivery
	// looks into each.
	remember := retention.Config{InboxGeneration: time.Microsecond, BrokerRetention: 364 * day, InboxRetention: 365 * day}
	perGeneration := maxRows / 16
	for g := 1; g <= 15; g++ {
		rep, err := tb.cleaner(t, remember).RunOnce(ctx)
		require.NoError(t, err)
		require.True(t, rep.Rotated)
		ago := 20 * day
		if g == 15 {
			ago = day // the newest generation stays
		}
		load(fmt.Sprintf("g%d-", g), perGeneration, ago)
	}
	rep, err := tb.cleaner(t, remember).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(16), rep.Generation)
	rates("16 rotations later", fmt.Sprintf("g0-%d-", maxRows/4))

	// The rows of the measurements are the only young ones of generation 0.
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_inbox")+` SET received_at = now() - interval '20 days' WHERE received_at > now() - interval '1 hour'`)
	var before int64
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT count(*) FROM `+tb.env.Q("txbox_inbox")).Scan(&before))
	// wal measures the write-ahead log a pass writes (the whole cluster's, so other activity adds).
	wal := func(pass func()) (time.Duration, int64) {
		var lsn string
		require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn))
		start := time.Now()
		pass()
		took := time.Since(start)
		var bytes int64
		require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::bigint`, lsn).Scan(&bytes))
		return took, bytes
	}
	took, walBytes := wal(func() {
		rep, err = tb.cleaner(t, rotating).RunOnce(ctx)
		require.NoError(t, err)
	})
	require.Len(t, rep.GenerationsDropped, 16, "all but the young generation and the current one")
	require.Zero(t, rep.DoneDeleted)
	require.NotContains(t, tb.partitions(t), "txbox_inbox_g0")
	var after int64
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT count(*) FROM `+tb.env.Q("txbox_inbox")).Scan(&after))
	require.Equal(t, int64(perGeneration), after, "the young generation stays")
	t.Logf("rotation and drop of %d generations (%d rows): %s, %d KiB of WAL",
		len(rep.GenerationsDropped), before-after, took.Round(time.Millisecond), walBytes>>10)
	rates("after the drop", "g15-")

	// For comparison, the same pass deleting rows one by one (rows past the cutoff in the current
	// generation, as in generation 0 before the first rotation).
	n := maxRows / 4
	load("straggler-", n, 20*day)
	took, walBytes = wal(func() {
		rep, err = tb.cleaner(t, retention.Config{BatchSize: 10000}).RunOnce(ctx)
		require.NoError(t, err)
	})
	require.Equal(t, int64(n), rep.DoneDeleted)
	t.Logf("deleting %d rows one by one, in batches of 10000: %s, %d KiB of WAL, and as many dead rows for VACUUM",
		n, took.Round(time.Millisecond), walBytes>>10)
}
