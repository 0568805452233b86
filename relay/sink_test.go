package relay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/relay"
)

// watermillPublisher is watermill-kafka's Publisher for brokers with marshaler.
func watermillPublisher(t *testing.T, brokers []string, marshaler kafka.Marshaler) message.Publisher {
	t.Helper()
	cfg := kafka.DefaultSaramaSyncPublisherConfig()
	cfg.Metadata.Retry.Backoff = 100 * time.Millisecond
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: marshaler, OverwriteSaramaConfig: cfg}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// A relay publishing through watermill-kafka's Publisher, with the partitioning marshaler that reads
// the partition key relay.PartitionKey hands it, puts every message of one key on one partition,
// in the order the key's transactions committed.
func TestWatermillSinkKeepsAKeyOnOnePartitionInOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cluster := strictCluster(t, kfake.SeedTopics(4, b.topic))
	log := readTopics(t, cluster.ListenAddrs(), b.topic)
	pub := watermillPublisher(t, cluster.ListenAddrs(), kafka.NewWithPartitioningMarshaler(relay.PartitionKey))

	written := map[string][]string{}
	for i := range 60 {
		key := fmt.Sprintf("key-%d", i%3)
		written[key] = append(written[key], b.write(t, true, key, 1)...)
	}
	var logs proctest.Buffer
	b.runRelayOn(t, relay.WatermillSink{Publisher: pub, KeyRouting: relay.RoutesByPartitionKey}, &logs, nil)
	var all []string
	for _, u := range written {
		all = append(all, u...)
	}
	require.Eventually(t, func() bool { return log.has(all...) && b.pending(t) == 0 }, 60*time.Second, 10*time.Millisecond)

	partitions, arrivals := log.partitionsOf(), log.firstArrivals()
	for key, uuids := range written {
		require.Len(t, partitions[key], 1, "key %s landed on one partition", key)
		require.Equal(t, uuids, arrivals[key], "order of key %s", key)
	}
}

// A WatermillSink cannot see how its publisher routes messages, so it must be told: without
// KeyRouting the relay refuses to start rather than spread a key's messages silently.
func TestWatermillSinkRequiresKeyRouting(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cluster := strictCluster(t)
	pub := watermillPublisher(t, cluster.ListenAddrs(), kafka.DefaultMarshaler{})
	_, err := relay.New(relay.Config{DB: b.env.Pool, Schema: b.env.Schema, Sink: relay.WatermillSink{Publisher: pub}})
	require.ErrorContains(t, err, "WatermillSink.KeyRouting")
	_, err = relay.New(relay.Config{DB: b.env.Pool, Schema: b.env.Schema, Sink: relay.WatermillSink{KeyRouting: relay.Unordered}})
	require.ErrorContains(t, err, "WatermillSink.Publisher")
	_, err = relay.New(relay.Config{DB: b.env.Pool, Schema: b.env.Schema, Sink: relay.WatermillSink{Publisher: pub, KeyRouting: relay.Unordered}})
	require.NoError(t, err)
}
