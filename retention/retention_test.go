package retention_test

import (
	"bytes"
	"context"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/retention"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const day = 24 * time.Hour

// countingDB records the rows each DELETE removed, to see the batches; a generation's counts as
// the inbox's.
type countingDB struct {
	*pgxpool.Pool
	mu      sync.Mutex
	batches map[string][]int64 // table → rows per statement
}

var generationTable = regexp.MustCompile(`^txbox_inbox_g[0-9]+$`)

func (db *countingDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := db.Pool.Exec(ctx, sql, args...)
	if err == nil && tag.Delete() {
		table := strings.Fields(strings.SplitN(sql, "FROM", 2)[1])[0]
		table = generationTable.ReplaceAllString(strings.Trim(table[strings.LastIndex(table, ".")+1:], `"`), "txbox_inbox")
		db.mu.Lock()
		db.batches[table] = append(db.batches[table], tag.RowsAffected())
		db.mu.Unlock()
	}
	return tag, err
}

type testBundle struct {
	env *txtest.Env
	db  *countingDB
	log *bytes.Buffer
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	env := txtest.New(t)
	return &testBundle{env: env, db: &countingDB{Pool: env.Pool, batches: map[string][]int64{}}, log: &bytes.Buffer{}}
}

func (tb *testBundle) cleaner(t *testing.T, cfg retention.Config) *retention.Cleaner {
	t.Helper()
	cfg.DB = tb.db
	cfg.Schema = tb.env.Schema
	if cfg.BrokerRetention == 0 {
		cfg.BrokerRetention = 7 * day
	}
	if cfg.InboxRetention == 0 {
		cfg.InboxRetention = 8 * day
	}
	cfg.Logger = slog.New(slog.NewTextHandler(tb.log, nil))
	c, err := retention.New(cfg)
	require.NoError(t, err)
	return c
}

func (tb *testBundle) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := tb.env.Pool.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// inbox adds n inbox rows for consumer with keys prefix-1…prefix-n, received ago.
func (tb *testBundle) inbox(t *testing.T, consumer, prefix, state string, n int, ago time.Duration) {
	t.Helper()
	tb.exec(t, `INSERT INTO `+tb.env.Q("txbox_inbox")+` (consumer, dedup_key, message_uuid, topic, state, received_at)
		SELECT $1, $2 || g, $2 || g, 'orders', $3, now() - $4 * interval '1 second' FROM generate_series(1, $5) AS g`,
		consumer, prefix+"-", state, ago.Seconds(), n)
}

// letter adds a dead letter from source that first failed ago.
func (tb *testBundle) letter(t *testing.T, source, consumer, key string, ago time.Duration) {
	t.Helper()
	tb.exec(t, `INSERT INTO `+tb.env.Q("txbox_dlq")+` (source, topic, consumer, dedup_key, uuid, payload, reason, first_failed_at)
		VALUES ($1, 'orders', $2, $3, $3, '', 'attempts exhausted', now() - $4 * interval '1 second')`, source, consumer, key, ago.Seconds())
}

func (tb *testBundle) keys(t *testing.T, table, where string) []string {
	t.Helper()
	rows, err := tb.env.Pool.Query(context.Background(), `SELECT dedup_key FROM `+tb.env.Q(table)+` WHERE `+where+` ORDER BY dedup_key`)
	require.NoError(t, err)
	defer rows.Close()
	var out []string
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		out = append(out, k)
	}
	require.NoError(t, rows.Err())
	return out
}

func (tb *testBundle) count(t *testing.T, table, where string) int {
	t.Helper()
	var n int
	require.NoError(t, tb.env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tb.env.Q(table)+` WHERE `+where).Scan(&n))
	return n
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	for _, tc := range []struct {
		name string
		cfg  retention.Config
		want string
	}{
		{"no DB", retention.Config{BrokerRetention: day}, "Config.DB is required"},
		{"no broker retention", retention.Config{DB: env.Pool}, "Config.BrokerRetention is required"},
		{"inbox not longer than broker", retention.Config{DB: env.Pool, BrokerRetention: 3 * day, InboxRetention: 3 * day},
			"Config.InboxRetention (72h0m0s) must be longer than Config.BrokerRetention (72h0m0s)"},
		{"default inbox retention against a longer broker retention", retention.Config{DB: env.Pool, BrokerRetention: 15 * day},
			"Config.InboxRetention (360h0m0s) must be longer than Config.BrokerRetention (360h0m0s)"},
		{"negative", retention.Config{DB: env.Pool, BrokerRetention: day, CallResultRetention: -day}, "Config.CallResultRetention must not be negative"},
		{"shorter than the provider's key lifetime", retention.Config{DB: env.Pool, BrokerRetention: day, CallResultRetention: 12 * time.Hour}, "Config.CallResultRetention must be at least 24h0m0s"},
		{"negative batch", retention.Config{DB: env.Pool, BrokerRetention: day, BatchSize: -1}, "Config.BatchSize must not be negative"},
		{"negative generation", retention.Config{DB: env.Pool, BrokerRetention: day, InboxGeneration: -day}, "Config.InboxGeneration must not be negative"},
		{"generation lock timeout below PostgreSQL's unit", retention.Config{DB: env.Pool, BrokerRetention: day, GenerationLockTimeout: time.Microsecond},
			"Config.GenerationLockTimeout must be at least 1ms"},
		{"passes without pause", retention.Config{DB: env.Pool, BrokerRetention: day, Interval: time.Nanosecond}, "Config.Interval must be at least 1s"},
		{"bad schema", retention.Config{DB: env.Pool, BrokerRetention: day, Schema: "Robert'); DROP"}, "Config.Schema"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := retention.New(tc.cfg)
			require.ErrorContains(t, err, tc.want)
		})
	}
	var logs proctest.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	_, err := retention.New(retention.Config{DB: env.Pool, BrokerRetention: 14 * day, Logger: logger})
	require.NoError(t, err, "the defaults are valid for Kafka's defaults: 7 days of retention.ms plus 7 of segment.ms")
	require.Empty(t, logs.String(), "the defaults are worth no warning")

	// Settings that work, but not as they say, are valid and warned about.
	_, err = retention.New(retention.Config{DB: env.Pool, BrokerRetention: time.Hour, InboxRetention: 2 * time.Hour,
		InboxGeneration: 3 * time.Hour, Interval: 4 * time.Hour, Logger: logger})
	require.NoError(t, err)
	require.Contains(t, logs.String(), "Interval is longer than InboxGeneration")
	require.Contains(t, logs.String(), "InboxGeneration is longer than InboxRetention")
}

func TestRunOnceDeletesOldProcessedRowsInBatches(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.inbox(t, "billing", "old", "done", 2500, 9*day)
	tb.inbox(t, "billing", "young", "done", 10, 7*day)
	tb.inbox(t, "shipping", "old", "done", 3, 30*day)

	rep, err := tb.cleaner(t, retention.Config{BatchSize: 1000}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(2503), rep.DoneDeleted)
	require.Equal(t, []int64{1000, 1000, 503}, tb.db.batches["txbox_inbox"][:3], "processed rows go in batches of BatchSize")
	require.Equal(t, 10, tb.count(t, "txbox_inbox", "true"))
	require.Equal(t, 10, tb.count(t, "txbox_inbox", "dedup_key LIKE 'young-%'"))
	require.Zero(t, rep.OldestLetterAge)
	require.WithinDuration(t, time.Now().Add(-8*day), rep.DoneCutoff, time.Minute)
}

func TestRunOnceKeepsDeadRowsOfLettersInTheDLQ(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.inbox(t, "billing", "waiting", "dead", 2, 20*day)
	tb.letter(t, "inbox", "billing", "waiting-1", 20*day)
	tb.letter(t, "inbox", "billing", "waiting-2", 20*day)
	tb.inbox(t, "billing", "discarded", "dead", 3, 9*day)
	tb.inbox(t, "billing", "recent", "dead", 1, 7*day)
	// A letter of another consumer with the same key does not keep billing's row.
	tb.letter(t, "inbox", "shipping", "discarded-1", time.Hour)

	rep, err := tb.cleaner(t, retention.Config{BatchSize: 2}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(3), rep.DeadDeleted)
	require.Equal(t, []string{"recent-1", "waiting-1", "waiting-2"}, tb.keys(t, "txbox_inbox", "true"))
}

// A redrive sends a message to every consumer of its topic again; the consumers that processed
// it must still have their 'done' rows, so the oldest inbox letter holds the cutoff back.
func TestRunOnceKeepsProcessedRowsAnInboxLetterMayNeed(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.letter(t, "inbox", "billing", "m-1", 5*day)
	tb.letter(t, "relay", "", "", 40*day) // Never delivered: it holds nothing back.
	tb.inbox(t, "shipping", "within", "done", 4, 12*day)
	tb.inbox(t, "shipping", "beyond", "done", 4, 14*day)

	rep, err := tb.cleaner(t, retention.Config{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(4), rep.DoneDeleted)
	require.Equal(t, 4, tb.count(t, "txbox_inbox", "dedup_key LIKE 'within-%'"))
	require.InDelta(t, (5 * day).Seconds(), rep.OldestLetterAge.Seconds(), 60)
	require.WithinDuration(t, time.Now().Add(-13*day), rep.DoneCutoff, time.Minute)
	require.NotContains(t, tb.log.String(), "level=WARN", "a letter younger than InboxRetention is no reason to warn")

	tb.letter(t, "inbox", "billing", "m-2", 10*day)
	_, err = tb.cleaner(t, retention.Config{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Contains(t, tb.log.String(), "level=WARN")
	require.Contains(t, tb.log.String(), "redrive or discard it")
}

func TestRunOnceDeletesOrphanedAttemptsAndOldCallResults(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	attempts := tb.env.Q("txbox_inbox_attempt")
	tb.exec(t, `INSERT INTO `+attempts+` (consumer, dedup_key, attempts, last_at) VALUES
		('billing', 'stale', 3, now() - interval '9 days'),
		('billing', 'retrying', 2, now() - interval '1 hour'),
		('billing', 'settled', 1, now())`)
	tb.inbox(t, "billing", "settled", "done", 1, 0)
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_inbox")+` SET dedup_key = 'settled'`)
	calls := tb.env.Q("txbox_call_result")
	tb.exec(t, `INSERT INTO `+calls+` (idempotency_key, call_uuid, outcome, http_status, attempts, duration_ms, completed_at) VALUES
		('old', 'c1', 'succeeded', 200, 1, 12, now() - interval '31 days'),
		('young', 'c2', 'succeeded', 200, 1, 12, now() - interval '29 days')`)

	rep, err := tb.cleaner(t, retention.Config{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(2), rep.AttemptsDeleted)
	require.Equal(t, []string{"retrying"}, tb.keys(t, "txbox_inbox_attempt", "true"))
	require.Equal(t, int64(1), rep.CallResultsDeleted)
	var left string
	require.NoError(t, tb.env.Pool.QueryRow(context.Background(), `SELECT string_agg(idempotency_key, ',') FROM `+calls).Scan(&left))
	require.Equal(t, "young", left)
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "true"), "a young processed row stays")
}

// Deduplication is per handler: a counter is settled by its own handler's inbox row or by a
// consumer-wide one, and a dead row is kept while its own handler's letter waits.
func TestRunOnceMatchesRowsByHandler(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.exec(t, `INSERT INTO `+tb.env.Q("txbox_inbox_attempt")+` (consumer, dedup_key, handler, attempts) VALUES
		('billing', 'other-handler-done', 'email', 1),
		('billing', 'own-handler-done', 'email', 1),
		('billing', 'consumer-wide-done', 'email', 1)`)
	tb.exec(t, `INSERT INTO `+tb.env.Q("txbox_inbox")+` (consumer, dedup_key, handler, message_uuid, topic, state, received_at) VALUES
		('billing', 'other-handler-done', 'charge', 'u', 'orders', 'done', now()),
		('billing', 'own-handler-done', 'email', 'u', 'orders', 'done', now()),
		('billing', 'consumer-wide-done', '', 'u', 'orders', 'done', now()),
		('billing', 'dead-letter-waits', 'charge', 'u', 'orders', 'dead', now() - interval '9 days'),
		('billing', 'dead-letter-discarded', 'charge', 'u', 'orders', 'dead', now() - interval '9 days')`)
	tb.exec(t, `INSERT INTO `+tb.env.Q("txbox_dlq")+` (source, topic, consumer, handler, dedup_key, uuid, payload, reason) VALUES
		('inbox', 'orders', 'billing', 'charge', 'dead-letter-waits', 'u', '', 'attempts exhausted'),
		('inbox', 'orders', 'billing', 'email', 'dead-letter-discarded', 'u', '', 'attempts exhausted')`)

	rep, err := tb.cleaner(t, retention.Config{}).RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, []string{"other-handler-done"}, tb.keys(t, "txbox_inbox_attempt", "true"))
	require.Equal(t, int64(1), rep.DeadDeleted)
	require.Equal(t, []string{"dead-letter-waits"}, tb.keys(t, "txbox_inbox", "state = 'dead'"))
}

func TestRunOnceReportsTableSizes(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	rep, err := tb.cleaner(t, retention.Config{}).RunOnce(context.Background())
	require.NoError(t, err)
	var names []string
	for _, s := range rep.Tables {
		names = append(names, s.Table)
		require.Positive(t, s.TotalBytes, s.Table)
	}
	require.Equal(t, []string{"txbox_outbox", "txbox_inbox", "txbox_inbox_attempt", "txbox_dlq", "txbox_redrive", "txbox_call_result"}, names)
	require.Contains(t, tb.log.String(), "txbox_inbox_bytes=")
}

func TestRunPassesAtOnceAndStopsWithTheContext(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.inbox(t, "billing", "old", "done", 5, 9*day)
	c := tb.cleaner(t, retention.Config{Interval: time.Hour})

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	require.Eventually(t, func() bool {
		var n int
		err := tb.env.Pool.QueryRow(ctx, `SELECT count(*) FROM `+tb.env.Q("txbox_inbox")).Scan(&n)
		return err == nil && n == 0
	}, 10*time.Second, 10*time.Millisecond)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
}
