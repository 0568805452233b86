package chaos_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/chaos"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// bundle is one test's installation: a migrated schema with the ledger and effects tables, and a
// topic of its own.
type bundle struct {
	env    *txtest.Env
	topic  string
	writer *outbox.Writer
}

func newBundle(t *testing.T, env *txtest.Env) *bundle {
	t.Helper()
	require.NoError(t, chaos.CreateTables(context.Background(), env.Pool, env.Schema))
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	return &bundle{env: env, topic: kafkatest.Topic(t), writer: w}
}

// write is a producer's transaction: msgs into the outbox and their ledger rows, committed after
// holding the transaction open for hold (so later transactions can commit first), or rolled back.
func (b *bundle) write(ctx context.Context, msgs []*message.Message, commit bool, hold time.Duration) error {
	tx, err := b.env.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // A no-op after Commit.
	uuids := make([]string, len(msgs))
	keys := make([]string, len(msgs))
	for i, m := range msgs {
		uuids[i], keys[i] = m.UUID, m.Metadata.Get(outbox.PartitionKeyMetadata)
	}
	if err := b.writer.Publish(ctx, tx, b.topic, msgs...); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+b.env.Q("produced")+" (uuid, key) SELECT * FROM unnest($1::text[], $2::text[])", uuids, keys); err != nil {
		return err
	}
	if hold > 0 {
		select {
		case <-time.After(hold):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if !commit {
		return tx.Rollback(ctx)
	}
	return tx.Commit(ctx)
}

func keyed(uuid, key, payload string) *message.Message {
	return outbox.SetPartitionKey(message.NewMessage(uuid, []byte(payload)), key)
}

// settled reports whether every committed message was applied by every consumer and the outbox is
// empty. Errors count as not settled: the database may be restarting.
func (b *bundle) settled(ctx context.Context, consumers []string) bool {
	missing, pending, err := b.backlog(ctx, consumers)
	return err == nil && missing == 0 && pending == 0
}

// backlog counts the (message, consumer) pairs not applied yet and the rows left in the outbox.
func (b *bundle) backlog(ctx context.Context, consumers []string) (missing, pending int, err error) {
	err = b.env.Pool.QueryRow(ctx, `
SELECT (SELECT count(*) FROM `+b.env.Q("produced")+` p CROSS JOIN unnest($1::text[]) AS c(name)
        WHERE NOT EXISTS (SELECT 1 FROM `+b.env.Q("effects")+` e WHERE e.uuid = p.uuid AND e.consumer = c.name)),
       (SELECT count(*) FROM `+b.env.Q("txbox_outbox")+`)`, consumers).Scan(&missing, &pending)
	return missing, pending, err
}

// count runs a count(*) query; errors count as -1.
func count(ctx context.Context, db *pgxpool.Pool, sql string, args ...any) int {
	var n int
	if err := db.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		return -1
	}
	return n
}

// outcome collects the run's outcome for chaos.Check.
func (b *bundle) outcome(t *testing.T, consumers []string) chaos.Outcome {
	t.Helper()
	o, err := chaos.Collect(context.Background(), b.env.Pool, b.env.Schema)
	require.NoError(t, err)
	o.Consumers = consumers
	return o
}

// requireNoViolations fails the test with every broken invariant.
func requireNoViolations(t *testing.T, o chaos.Outcome) {
	t.Helper()
	vs := chaos.Check(o)
	var lines []string
	for _, v := range vs {
		lines = append(lines, v.String())
	}
	require.Empty(t, lines, "broken invariants (%d committed messages, %d effects)", len(o.Committed), len(o.Effects))
}

// startRelay runs an in-process relay over db until the test ends.
func (b *bundle) startRelay(t *testing.T, db relay.DB) {
	t.Helper()
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t), TransactionalIDPrefix: b.env.Schema})
	require.NoError(t, err)
	r, err := relay.New(relay.Config{
		DB: db, Sink: sink, Schema: b.env.Schema,
		Shards: 4, LeaseTTL: time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

// startConsumer runs an in-process consumer named name (a Watermill router, a read_committed
// subscriber, the inbox and chaos.Apply) until the test ends.
func (b *bundle) startConsumer(t *testing.T, name string) {
	t.Helper()
	ib, err := inbox.New(inbox.Config{DB: b.env.Pool, Consumer: name, Schema: b.env.Schema}, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(ib.Middleware)
	router.AddConsumerHandler("effects", b.topic, kafkatest.NewSubscriber(t, name+"-"+b.env.Schema), chaos.Apply(b.env.Schema, nil))
	txtest.RunRouter(t, router)
}

// consumerArgs are the flags of a txbox-consumer process named name. Its consumer group uses
// static membership, as a StatefulSet would have it, so a restarted process takes its predecessor's
// partitions at once: with dynamic membership, kfake now and then never expires a member killed
// during a rebalance, and the partitions it was given are consumed by nobody.
func (b *bundle) consumerArgs(t *testing.T, name string, extra ...string) []string {
	return append([]string{
		"--database-url", b.env.URL, "--schema", b.env.Schema,
		"--kafka-brokers", strings.Join(kafkatest.Brokers(t), ","), "--topic", b.topic,
		"--consumer", name, "--group", name + "-" + b.env.Schema, "--instance-id", name,
	}, extra...)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
