package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// strictCluster starts an in-process Kafka cluster of the test's own that, like a production
// cluster, does not create topics on first use: only the seeded topics exist.
func strictCluster(t *testing.T, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	base := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.DefaultNumPartitions(3),
		kfake.GroupMinSessionTimeout(100 * time.Millisecond),
	}
	c, err := kfake.NewCluster(append(base, opts...)...)
	require.NoError(t, err)
	t.Cleanup(c.Close)
	return c
}

// kafkaSink returns a KafkaSink for brokers with the bundle's transactional id prefix.
func (b *bundle) kafkaSink(t *testing.T, brokers []string, transactional bool) *relay.KafkaSink {
	t.Helper()
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers, TransactionalIDPrefix: b.env.Schema, Transactional: &transactional})
	require.NoError(t, err)
	return sink
}

// runRelayOn runs an in-process relay with one shard that publishes to sink, logging to logs,
// until the test ends or stop is called; stop returns how long Run took to return.
func (b *bundle) runRelayOn(t *testing.T, sink relay.Sink, logs *proctest.Buffer, mutate func(*relay.Config)) (r *relay.Relay, stop func() time.Duration) {
	t.Helper()
	cfg := relay.Config{
		DB: b.env.Pool, Sink: sink, Schema: b.env.Schema,
		Shards: 1, LeaseTTL: 2 * time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	r, err := relay.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stop = sync.OnceValue(func() time.Duration {
		start := time.Now()
		cancel()
		require.NoError(t, <-done)
		return time.Since(start)
	})
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			t.Logf("relay log:\n%s", logs.String())
		}
	})
	return r, stop
}

// topicLog reads every partition of topics with read_committed, from the start, and keeps what
// arrives.
type topicLog struct {
	mu      sync.Mutex
	records []record
}

// record is one Kafka record as read: its message's UUID and partition key come from the headers
// watermill-kafka's marshaler writes, whatever the record's own key.
type record struct {
	topic     string
	partition int32
	uuid, key string
}

func readTopics(t *testing.T, brokers []string, topics ...string) *topicLog {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.Consumer.IsolationLevel = sarama.ReadCommitted
	cfg.Metadata.Retry.Backoff = 100 * time.Millisecond
	consumer, err := sarama.NewConsumer(brokers, cfg)
	require.NoError(t, err)
	l := &topicLog{}
	var wg sync.WaitGroup
	var open []sarama.PartitionConsumer
	t.Cleanup(func() {
		for _, pc := range open {
			_ = pc.Close()
		}
		_ = consumer.Close()
		wg.Wait()
	})
	for _, topic := range topics {
		partitions, err := consumer.Partitions(topic)
		require.NoError(t, err)
		for _, p := range partitions {
			pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
			require.NoError(t, err)
			open = append(open, pc)
			wg.Go(func() {
				for m := range pc.Messages() {
					rec := record{topic: topic, partition: p}
					for _, h := range m.Headers {
						switch string(h.Key) {
						case "_watermill_message_uuid":
							rec.uuid = string(h.Value)
						case outbox.PartitionKeyMetadata:
							rec.key = string(h.Value)
						}
					}
					l.mu.Lock()
					l.records = append(l.records, rec)
					l.mu.Unlock()
				}
			})
		}
	}
	return l
}

// has reports whether every uuid arrived.
func (l *topicLog) has(uuids ...string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	seen := map[string]bool{}
	for _, r := range l.records {
		seen[r.uuid] = true
	}
	for _, u := range uuids {
		if !seen[u] {
			return false
		}
	}
	return true
}

// firstArrivals returns, per key, the UUIDs in the order of their first arrival.
func (l *topicLog) firstArrivals() map[string][]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string][]string{}
	seen := map[string]bool{}
	for _, r := range l.records {
		if !seen[r.uuid] {
			seen[r.uuid] = true
			out[r.key] = append(out[r.key], r.uuid)
		}
	}
	return out
}

// partitionsOf returns, per key, the partitions its records landed on.
func (l *topicLog) partitionsOf() map[string]map[int32]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]map[int32]bool{}
	for _, r := range l.records {
		if out[r.key] == nil {
			out[r.key] = map[int32]bool{}
		}
		out[r.key][r.partition] = true
	}
	return out
}

// writeTo writes one message with key to topic, with one metadata entry unless metaKey is empty, in
// a transaction of its own, and returns its UUID.
func (b *bundle) writeTo(t *testing.T, topic, key string, payload []byte, metaKey, metaValue string) string {
	t.Helper()
	ctx := context.Background()
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	m := outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), payload), key)
	if metaKey != "" {
		m.Metadata.Set(metaKey, metaValue)
	}
	require.NoError(t, b.writer.Publish(ctx, tx, topic, m))
	require.NoError(t, tx.Commit(ctx))
	return m.UUID
}

// auditCompletions records when each outbox row was deleted (published, executed or dead), by the
// database's clock at that instant.
func (b *bundle) auditCompletions(t *testing.T) {
	t.Helper()
	s := pgx.Identifier{b.env.Schema}.Sanitize()
	_, err := b.env.Pool.Exec(context.Background(), fmt.Sprintf(`
CREATE TABLE %[1]s.completed (uuid text NOT NULL, at timestamptz NOT NULL);
CREATE FUNCTION %[1]s.audit_completion() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO %[1]s.completed VALUES (OLD.uuid, clock_timestamp());
	RETURN OLD;
END $$;
CREATE TRIGGER audit_completion AFTER DELETE ON %[1]s.txbox_outbox FOR EACH ROW EXECUTE FUNCTION %[1]s.audit_completion();`, s))
	require.NoError(t, err)
}

func (b *bundle) completedAt(t *testing.T, uuid string) time.Time {
	t.Helper()
	var at time.Time
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT at FROM "+b.env.Q("completed")+" WHERE uuid = $1", uuid).Scan(&at))
	return at
}

// relayLetter is a dead letter the relay wrote.
type relayLetter struct {
	uuid, topic, reason, errText string
	attempts                     int
}

func (b *bundle) relayLetters(t *testing.T) []relayLetter {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(),
		"SELECT uuid, topic, reason, error, attempts FROM "+b.env.Q("txbox_dlq")+" WHERE source = 'relay' ORDER BY id")
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (relayLetter, error) {
		var l relayLetter
		err := row.Scan(&l.uuid, &l.topic, &l.reason, &l.errText, &l.attempts)
		return l, err
	})
	require.NoError(t, err)
	return out
}

// TestUnpublishableRowGoesToTheDLQ writes, first in its shard, a row the broker refuses, then rows
// of other keys and one more row of the refused row's key; the broker does not create topics on
// first use, like a production cluster. The other keys must be published without waiting for the
// refused row; the refused row goes to the DLQ with its reason, at once when no retry can help
// (an invalid topic name, a record too large) and after Config.MaxPublishAttempts attempts when
// one could (a topic that does not exist yet, a topic the relay may not write to); the later row
// of its key waits behind it and is published once it is dead; no innocent row is dead, nothing
// is lost. Both with Kafka transactions (a refused record aborts its whole batch, and an
// authorization failure is reported against every record of the batch) and without.
func TestUnpublishableRowGoesToTheDLQ(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name           string
		topic          string // appended to the seeded topic's name to make the refused row's topic
		payload        int    // the refused row's payload size
		metadata       int    // the size of a metadata value of the refused row
		opts           func(good, bad string) []kfake.Opt
		permanent      bool   // buried at once rather than after MaxPublishAttempts
		idempotentOnly bool   // see "record too large for the broker"
		reason         string // the letter's reason
		errText        string // in the letter's error
	}{
		{name: "unknown topic", topic: "-missing", reason: relay.ReasonPublishAttemptsExhausted, errText: "does not exist"},
		{name: "invalid topic name", topic: " no spaces allowed!", permanent: true, reason: relay.ReasonRejected, errText: "invalid"},
		{
			name: "topic not authorized", topic: "-forbidden", reason: relay.ReasonPublishAttemptsExhausted, errText: "not authorized",
			opts: func(_, bad string) []kfake.Opt { return []kfake.Opt{kfake.SeedTopics(3, bad)} },
		},
		{
			// The outbox takes payloads up to its limit and metadata of any size; the record is then
			// larger than the client sends (Producer.MaxMessageBytes, 1 MiB by default).
			name: "record too large", payload: outbox.DefaultMaxPayloadBytes, metadata: 64 << 10,
			permanent: true, reason: relay.ReasonRejected, errText: "too large",
		},
		{
			// The broker takes smaller records than the relay's client: it refuses the record
			// batch, with every record in it, and the relay must find the one to blame. Only
			// without transactions: inside one, sarama 1.61.1 races on its own transaction state
			// when a broker refuses records (an unsynchronised read of transactionManager.lastError),
			// which the race detector reports.
			name: "record too large for the broker", payload: 200 << 10, permanent: true, reason: relay.ReasonRejected, errText: "too large",
			idempotentOnly: true,
			opts: func(string, string) []kfake.Opt {
				return []kfake.Opt{kfake.BrokerConfigs(map[string]string{"message.max.bytes": fmt.Sprint(100 << 10)})}
			},
		},
	} {
		for _, transactional := range []bool{true, false} {
			if transactional && tc.idempotentOnly {
				continue
			}
			t.Run(tc.name+"/"+map[bool]string{true: "transactional", false: "idempotent"}[transactional], func(t *testing.T) {
				t.Parallel()
				b := setup(t)
				good := b.topic
				bad := good + tc.topic
				opts := []kfake.Opt{kfake.SeedTopics(3, good)}
				if tc.opts != nil {
					opts = append(opts, tc.opts(good, bad)...)
				}
				cluster := strictCluster(t, opts...)
				if tc.name == "topic not authorized" {
					cluster.Fault(kfake.Fault{Topic: bad, Err: kerr.TopicAuthorizationFailed, Count: -1})
				}
				b.auditCompletions(t)
				log := readTopics(t, cluster.ListenAddrs(), good)

				refused := b.writeTo(t, bad, "k-bad", make([]byte, tc.payload), "filler", strings.Repeat("x", tc.metadata))
				var others []string
				for i := range 20 {
					others = append(others, b.writeTo(t, good, fmt.Sprintf("k%d", i%5), []byte(`{"n":1}`), "", ""))
				}
				behind := b.writeTo(t, good, "k-bad", []byte(`{"n":2}`), "", "")

				var logs proctest.Buffer
				b.runRelayOn(t, b.kafkaSink(t, cluster.ListenAddrs(), transactional), &logs, func(c *relay.Config) {
					c.MaxPublishAttempts = 3
					c.MinPublishBackoff, c.MaxPublishBackoff = time.Second, time.Second
				})

				require.Eventually(t, func() bool { return log.has(others...) }, 60*time.Second, 10*time.Millisecond,
					"the other keys of the shard were published")
				require.Eventually(t, func() bool { return len(b.relayLetters(t)) > 0 }, 60*time.Second, 10*time.Millisecond,
					"the refused row went to the DLQ")
				require.Eventually(t, func() bool { return log.has(behind) && b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond,
					"the later row of its key was published once it was dead")

				letters := b.relayLetters(t)
				require.Len(t, letters, 1, "only the refused row is dead")
				l := letters[0]
				require.Equal(t, refused, l.uuid)
				require.Equal(t, bad, l.topic)
				require.Equal(t, tc.reason, l.reason)
				require.Contains(t, strings.ToLower(l.errText), tc.errText)
				dead := b.completedAt(t, refused)
				if tc.permanent {
					require.Equal(t, 1, l.attempts)
				} else {
					require.Equal(t, 3, l.attempts, "dead after MaxPublishAttempts")
					var retriedFor time.Duration
					require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT (extract(epoch FROM last_failed_at - first_failed_at) * 1e9)::bigint FROM "+
						b.env.Q("txbox_dlq")+" WHERE uuid = $1", refused).Scan(&retriedFor))
					require.GreaterOrEqual(t, retriedFor, time.Second, "the letter first failed at the first refusal, a backoff before the last")
					for _, u := range others {
						require.True(t, b.completedAt(t, u).Before(dead), "%s was published while the refused row was still being retried", u)
					}
				}
				require.True(t, b.completedAt(t, behind).After(dead), "the later row of the refused row's key waited behind it")
				require.NotContains(t, log.firstArrivals()["k-bad"], refused)
				for k, uuids := range log.firstArrivals() {
					var want []string
					for i, u := range others {
						if fmt.Sprintf("k%d", i%5) == k {
							want = append(want, u)
						}
					}
					if k == "k-bad" {
						want = []string{behind}
					}
					require.Equal(t, want, uuids, "order of key %s", k)
				}
			})
		}
	}
}
