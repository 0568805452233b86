package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/relay"
)

// The shard count is lowered (4 to 2) after a relay of the old layout was killed with a Kafka
// transaction open under the transactional ID of shard 3, which the new layout has no producer
// for: the relay that starts with the new layout aborts that transaction and fences its producer
// before it forgets the old layout's leases. Before, nothing did, and read_committed consumers of
// its partitions received nothing, the new relay's messages included, until the broker's
// transaction timeout aborted it (sarama's default, a minute; ten minutes here), and a frozen
// relay of the old layout could still commit it when it woke.
func TestLoweringTheShardCountFencesTheDroppedShardsTransactions(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t), TransactionalIDPrefix: b.env.Schema})
	require.NoError(t, err)
	old, err := relay.New(relay.Config{
		DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Shards: 4, LeaseTTL: 2 * time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	require.NoError(t, err)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- old.Run(ctx) }()
	b.write(t, true, "k", 3)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)
	stop()
	require.NoError(t, <-done)

	// The old relay as if killed mid-batch: its lease of shard 3 ran out, its transaction is open
	// over every partition.
	cfg := kafkatest.TransactionalProducer(b.env.Schema + "-shard-3")
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	cfg.Producer.Transaction.Timeout = 10 * time.Minute
	client, err := sarama.NewClient(kafkatest.Brokers(t), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = client.Close() })
	killed, err := sarama.NewSyncProducerFromClient(client)
	require.NoError(t, err)
	t.Cleanup(func() { _ = killed.Close() })
	partitions, err := client.Partitions(b.topic)
	require.NoError(t, err)
	require.NoError(t, killed.BeginTxn())
	for _, p := range partitions {
		_, _, err := killed.SendMessage(&sarama.ProducerMessage{Topic: b.topic, Partition: p, Value: sarama.StringEncoder("open")})
		require.NoError(t, err)
	}
	_, err = b.env.Pool.Exec(context.Background(), "UPDATE "+b.env.Q("txbox_lease")+
		" SET owner = 'killed', expires_at = now() - interval '1 second' WHERE shard = 3")
	require.NoError(t, err)

	log := b.record(t, sarama.ReadCommitted)
	r := b.startRelay(t, func(c *relay.Config) { c.Shards = 2 })
	require.Eventually(t, func() bool { return len(r.Shards()) == 2 }, 30*time.Second, 10*time.Millisecond)
	require.Error(t, killed.CommitTxn(), "the killed relay's producer could still commit its transaction")

	var uuids []string
	for i := range 9 {
		uuids = append(uuids, b.write(t, true, fmt.Sprint("key-", i), 1)...)
	}
	require.Eventually(t, func() bool { return log.has(uuids...) }, 30*time.Second, 10*time.Millisecond, "read_committed consumers are held back by the open transaction")
	var leases int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.env.Q("txbox_lease")).Scan(&leases))
	require.Equal(t, 2, leases, "the old layout's leases are gone")
}
