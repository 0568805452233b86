// Package kafkatest gives tests a Kafka cluster reached over TCP through the same sarama and
// watermill-kafka code production uses: the cluster named by TXBOX_KAFKA_BROKERS when it is set,
// otherwise an in-process kfake cluster on loopback, one per test binary.
package kafkatest

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txbox/txbox/kafkasub"
)

// EnvVar switches the tests to a real cluster: a comma-separated broker list.
const EnvVar = "TXBOX_KAFKA_BROKERS"

var (
	once    sync.Once
	brokers []string
	cluster *kfake.Cluster
	fakeErr error
)

// Brokers returns the broker addresses for this test binary.
func Brokers(t testing.TB) []string {
	t.Helper()
	once.Do(func() {
		if env := os.Getenv(EnvVar); env != "" {
			brokers = strings.Split(env, ",")
			return
		}
		cluster, fakeErr = Start()
		if fakeErr == nil {
			brokers = cluster.ListenAddrs()
		}
	})
	if fakeErr != nil {
		t.Fatalf("kafkatest: start the in-process Kafka cluster: %v (or set %s to a real cluster)", fakeErr, EnvVar)
	}
	return brokers
}

// Start starts an in-process cluster on loopback, tuned for fast tests: topics are created on first
// use and consumer groups accept short session timeouts.
func Start(opts ...kfake.Opt) (*kfake.Cluster, error) {
	base := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.AllowAutoTopicCreation(),
		kfake.DefaultNumPartitions(3),
		kfake.GroupMinSessionTimeout(100 * time.Millisecond),
	}
	return kfake.NewCluster(append(base, opts...)...)
}

// Topic returns a topic name unique to this call, so tests sharing a cluster do not see each
// other's messages.
func Topic(t testing.TB) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	// Kafka topic names take only these characters; test names take any.
	name := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-' {
			return r
		}
		return '_'
	}, t.Name())
	if len(name) > 100 {
		name = name[:100]
	}
	return "test_" + name + "_" + hex.EncodeToString(b)
}

// SubscriberConfig returns kafkasub's subscriber configuration with short timeouts for tests. A real
// cluster (EnvVar) refuses session timeouts below its group.min.session.timeout.ms, 6 s by
// default; kfake is started to take short ones.
func SubscriberConfig(brokers []string, group string) kafka.SubscriberConfig {
	c := kafkasub.SubscriberConfig(brokers, group)
	s := c.OverwriteSaramaConfig
	s.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	s.Consumer.Group.Session.Timeout = 2 * time.Second
	if os.Getenv(EnvVar) != "" {
		s.Consumer.Group.Session.Timeout = 6 * time.Second
	}
	s.Consumer.Group.Heartbeat.Interval = 200 * time.Millisecond
	s.Consumer.Group.Rebalance.Timeout = 3 * time.Second
	s.Metadata.Retry.Backoff = 100 * time.Millisecond
	// When several members of one group leave at once, kfake sometimes leaves a JoinGroup
	// unanswered until the client's read timeout (65s in SaramaConfig) expires; the member then
	// retries. A legitimate JoinGroup waits at most the rebalance timeout, and the read timeout
	// must outlast that by 5s (see kafkasub.SaramaConfig).
	s.Net.ReadTimeout = 10 * time.Second
	return c
}

// NewSubscriber returns a read_committed watermill-kafka subscriber in consumer group group, closed
// when the test ends.
func NewSubscriber(t testing.TB, group string) *kafka.Subscriber {
	t.Helper()
	sub, err := kafka.NewSubscriber(SubscriberConfig(Brokers(t), group), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("kafkatest: subscriber: %v", err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// TransactionalProducer configures a sarama producer under transactional ID id, as a relay opens
// one: a test's stand-in for another relay (a zombie, a killed one, one whose lease ended).
func TransactionalProducer(id string) *sarama.Config {
	c := sarama.NewConfig()
	c.Version = sarama.V2_8_0_0
	c.Producer.Idempotent = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Return.Successes = true
	c.Net.MaxOpenRequests = 1
	c.Producer.Transaction.ID = id
	return c
}
