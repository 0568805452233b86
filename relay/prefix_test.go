package relay_test

import (
	"context"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/migrations"
	"github.com/txbox/txbox/relay"
)

// Two outboxes publish to one Kafka cluster, each relay with the default transactional-ID prefix.
// Each outbox's prefix derives from its own identity, so neither relay's producers fence the
// other's (with one fixed default they did, several times a second, for as long as both ran). One
// sink left without a prefix cannot serve the relays of both, and a relay with a prefix of its own
// does not start beside the running relay of its outbox. The collision needs a cluster of
// the test's own, so this test always uses an in-process cluster.
func TestTwoOutboxesOnOneClusterDoNotFenceEachOther(t *testing.T) {
	t.Parallel()
	cluster, err := kafkatest.Start()
	require.NoError(t, err)
	t.Cleanup(cluster.Close)
	brokers := cluster.ListenAddrs()

	type outboxRelay struct {
		b    *bundle
		sink *relay.KafkaSink
		logs *proctest.Buffer
	}
	run := func(t *testing.T, b *bundle, sink *relay.KafkaSink, logs *proctest.Buffer) <-chan error {
		r, err := relay.New(relay.Config{
			DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Shards: 4,
			LeaseTTL: 2 * time.Second, PollInterval: 10 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(logs, nil)),
		})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done, stopped := make(chan error, 1), make(chan struct{})
		go func() {
			done <- r.Run(ctx)
			close(stopped)
		}()
		t.Cleanup(func() {
			cancel()
			<-stopped
		})
		return done
	}
	var outboxes []outboxRelay
	for range 2 {
		sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers})
		require.NoError(t, err)
		o := outboxRelay{b: setup(t), sink: sink, logs: &proctest.Buffer{}}
		run(t, o.b, o.sink, o.logs)
		outboxes = append(outboxes, o)
	}
	for range 5 {
		for _, o := range outboxes {
			o.b.write(t, true, "k", 50)
		}
		for _, o := range outboxes {
			require.Eventually(t, func() bool { return o.b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)
		}
	}
	prefix := regexp.MustCompile(`transactional_id_prefix=(txbox-\w+)`)
	var prefixes []string
	for _, o := range outboxes {
		require.NotContains(t, o.logs.String(), "producer fenced", "another outbox's relay fenced this one's producers")
		m := prefix.FindStringSubmatch(o.logs.String())
		require.NotNil(t, m, "the start line names the prefix:\n%s", o.logs.String())
		prefixes = append(prefixes, m[1])
	}
	require.NotEqual(t, prefixes[0], prefixes[1])

	done := run(t, outboxes[1].b, outboxes[0].sink, &proctest.Buffer{})
	select {
	case err := <-done:
		require.ErrorContains(t, err, "serves the relays of two outboxes")
	case <-time.After(30 * time.Second):
		t.Fatal("a relay ran with another outbox's sink")
	}

	// A relay of the first outbox with a prefix of its own would not be fenced by its relay.
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers, TransactionalIDPrefix: "elsewhere"})
	require.NoError(t, err)
	done = run(t, outboxes[0].b, sink, &proctest.Buffer{})
	select {
	case err := <-done:
		require.ErrorContains(t, err, `KafkaConfig.TransactionalIDPrefix is "elsewhere" but running relay`)
		require.ErrorContains(t, err, "publishes with "+strconv.Quote(prefixes[0]))
	case <-time.After(30 * time.Second):
		t.Fatal("a relay ran with another prefix than the running relay of its outbox")
	}
}

// A relay of a version before migration 00012 records no transactional-ID prefix: one started
// beside it with the outbox's default prefix would not fence its frozen transactions, and is
// refused; one given a prefix (the older version's, as the README's upgrade note says) starts.
func TestARelayBesideARelayOfAnOlderVersionNeedsItsPrefix(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.env.Pool.Exec(context.Background(), "INSERT INTO "+b.env.Q("txbox_relay_node")+
		" (owner, expires_at) VALUES ('old-relay', now() + interval '1 hour')")
	require.NoError(t, err)
	start := func(prefix string) (*relay.Relay, <-chan error) {
		sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t), TransactionalIDPrefix: prefix})
		require.NoError(t, err)
		r, err := relay.New(relay.Config{
			DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Shards: 4, LeaseTTL: 2 * time.Second,
			Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done, stopped := make(chan error, 1), make(chan struct{})
		go func() {
			done <- r.Run(ctx)
			close(stopped)
		}()
		t.Cleanup(func() {
			cancel()
			<-stopped
		})
		return r, done
	}
	_, done := start("")
	select {
	case err := <-done:
		require.ErrorContains(t, err, `running relay "old-relay" is of a version before migration 00012`)
	case <-time.After(30 * time.Second):
		t.Fatal("a relay with the outbox's default prefix ran beside a relay of an older version")
	}
	r, _ := start("txbox")
	require.Eventually(t, func() bool { return len(r.Shards()) > 0 }, 30*time.Second, 10*time.Millisecond)
}

// A relay of a version before migration 00012 that was killed (or froze) left its Kafka
// transactions open under its own transactional IDs: the broker aborts them one transaction
// timeout after they began, and until then read_committed consumers of their partitions see
// nothing, the new relay's messages included. A relay with the outbox's default prefix, whose
// producers would not abort them, waits that long after the old relay's heartbeat ran out; one
// given the old prefix starts, its producers aborting them. Before, it started once the heartbeat
// ran out, and an upgrade audit saw a partition's consumers receive nothing for 55 s after the old
// relay's kill -9, then 12198 records at once.
func TestARelayWaitsOutTheTransactionsOfAKilledRelayOfAnOlderVersion(t *testing.T) {
	t.Parallel()
	b := setup(t)
	start := func(prefix string) (*relay.Relay, <-chan error) {
		sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t), TransactionalIDPrefix: prefix})
		require.NoError(t, err)
		r, err := relay.New(relay.Config{
			DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Shards: 4, LeaseTTL: 2 * time.Second,
			Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		done, stopped := make(chan error, 1), make(chan struct{})
		go func() {
			done <- r.Run(ctx)
			close(stopped)
		}()
		t.Cleanup(func() {
			cancel()
			<-stopped
		})
		return r, done
	}
	oldRelay := func(lastHeartbeatRanOut string) {
		_, err := b.env.Pool.Exec(context.Background(), "INSERT INTO "+b.env.Q("txbox_relay_node")+
			" (owner, expires_at) VALUES ('old-relay', now() - $1::interval) ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at",
			lastHeartbeatRanOut)
		require.NoError(t, err)
	}

	oldRelay("5 seconds")
	_, done := start("")
	select {
	case err := <-done:
		require.ErrorContains(t, err, `relay "old-relay", of a version before migration 00012`)
		require.ErrorContains(t, err, "stopped renewing its heartbeat without stopping cleanly")
		require.Regexp(t, `up to 1m0s after it began.*start this relay in 5[56]s`, err.Error())
	case <-time.After(30 * time.Second):
		t.Fatal("a relay with the outbox's default prefix started while a killed relay of an older version may hold a transaction open")
	}
	r, _ := start("txbox")
	require.Eventually(t, func() bool { return len(r.Shards()) > 0 }, 30*time.Second, 10*time.Millisecond,
		"a relay with the old relay's prefix starts: its producers abort the old relay's transactions")

	b2 := setup(t)
	b = b2
	oldRelay("61 seconds")
	r, _ = start("")
	require.Eventually(t, func() bool { return len(r.Shards()) > 0 }, 30*time.Second, 10*time.Millisecond,
		"once the broker has aborted the old relay's transactions, a relay with the default prefix starts")
}

// A relay of a version before migration 00012 that starts after this one checks nothing and joins
// (an old pod restarting during a rollout): this relay says so, once, as an error naming it. Before,
// nothing was logged, though their producers do not fence each other.
func TestARelayLogsARelayOfAnOlderVersionThatJoinsIt(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := &errorLog{}
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t)})
	require.NoError(t, err)
	r, err := relay.New(relay.Config{
		DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Shards: 4, LeaseTTL: time.Second,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelError})),
	})
	require.NoError(t, err)
	runUntilCleanup(t, context.Background(), r)
	require.Eventually(t, func() bool { return len(r.Shards()) > 0 }, 30*time.Second, 10*time.Millisecond)

	_, err = b.env.Pool.Exec(context.Background(), "INSERT INTO "+b.env.Q("txbox_relay_node")+
		" (owner, expires_at) VALUES ('old-relay', now() + interval '1 hour')")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), `relay=old-relay`) }, 30*time.Second, 20*time.Millisecond)
	require.Contains(t, logs.String(), "another transactional-ID prefix")
	require.Contains(t, logs.String(), "a version before migration 00012")
	time.Sleep(2 * time.Second) // several balance rounds
	require.Equal(t, 1, strings.Count(logs.String(), "relay=old-relay"), "said once")
}

// txbox migrate down and up under a running relay that publishes with the outbox's default
// prefix: the new outbox has a new identity, and so a new prefix. The relay carries on in it,
// registered with the new prefix (so a relay started there is not refused as one of another
// prefix), and ready. Before, it stayed live holding no shard, reported ready, and made any new
// relay fail to start.
func TestARelayCarriesOnWhenItsOutboxIsMadeAnew(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	logs := &proctest.Buffer{}
	withDefaultPrefix := func(logs *proctest.Buffer) func(*relay.Config) {
		return func(cfg *relay.Config) {
			sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t)})
			require.NoError(t, err)
			cfg.Sink = sink
			cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
		}
	}
	r := b.startRelay(t, withDefaultPrefix(logs))
	before := b.write(t, true, "k", 3)
	require.Eventually(t, func() bool { return c.has(before...) && b.pending(t) == 0 }, 30*time.Second, 20*time.Millisecond)

	db := stdlib.OpenDBFromPool(b.env.Pool)
	t.Cleanup(func() { _ = db.Close() })
	ctx := context.Background()
	_, err := migrations.Down(ctx, db, migrations.WithSchema(b.env.Schema))
	require.NoError(t, err)
	_, err = migrations.Up(ctx, db, migrations.WithSchema(b.env.Schema))
	require.NoError(t, err)

	after := b.write(t, true, "k", 3)
	require.Eventually(t, func() bool { return c.has(after...) }, 30*time.Second, 20*time.Millisecond,
		"the relay publishes the new outbox's rows:\n%s", logs)
	require.Contains(t, logs.String(), "the outbox was made anew")
	require.Eventually(t, func() bool { return r.Ready() == nil }, 30*time.Second, 20*time.Millisecond)

	// A relay started in the new outbox meets the running one under the same prefix.
	second := b.startRelay(t, withDefaultPrefix(&proctest.Buffer{}))
	require.Eventually(t, func() bool { return len(second.Shards()) > 0 }, 30*time.Second, 20*time.Millisecond,
		"the relay started in the new outbox takes its share")
}
