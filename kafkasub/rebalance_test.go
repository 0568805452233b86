package kafkasub_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/kafkasub"
)

// The broker may hold a JoinGroup for the rebalance timeout; the read timeout outlasts it, by the
// margin Kafka's Java client gives a JoinGroup.
func TestSaramaConfigWaitsOutTheRebalanceTimeout(t *testing.T) {
	t.Parallel()
	c := kafkasub.SaramaConfig()
	require.NoError(t, c.Validate())
	require.Equal(t, 60*time.Second, c.Consumer.Group.Rebalance.Timeout, "sarama's default")
	require.Equal(t, c.Consumer.Group.Rebalance.Timeout+5*time.Second, c.Net.ReadTimeout)
}

// A member handling a message rejoins its group only once the message is acknowledged, so the
// broker holds the JoinGroup of a member that joins meanwhile until the rebalance timeout runs out,
// and then completes the rebalance without the busy member. A read timeout shorter than the
// rebalance timeout cuts that JoinGroup off and the member joins again, which starts kfake's wait
// anew, so the rebalance never completes. Here the first member holds its messages until the second
// receives one, and the read timeout given is below the rebalance timeout: NewSubscriber raises it,
// the second member gets the partitions when the rebalance timeout runs out, and once the first
// lets go, both receive what is published after.
func TestAMemberJoiningBesideABusyOneReceivesMessages(t *testing.T) {
	t.Parallel()
	brokers, topic := kafkatest.Brokers(t), kafkatest.Topic(t)
	const partitions = 2 // One for each member, once both are in the group.
	publish := newPartitionPublisher(t, brokers, topic, partitions)
	cfg := kafkatest.SubscriberConfig(brokers, "join-"+watermill.NewShortUUID())
	cfg.OverwriteSaramaConfig.Consumer.Group.Rebalance.Timeout = 3 * time.Second
	cfg.OverwriteSaramaConfig.Net.ReadTimeout = time.Second

	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	received := map[string]map[string]bool{"busy": {}, "joining": {}} // payloads by member
	receivedBy := func(member, prefix string) bool {
		mu.Lock()
		defer mu.Unlock()
		for payload := range received[member] {
			if strings.HasPrefix(payload, prefix) {
				return true
			}
		}
		return false
	}
	holding, release := make(chan struct{}), make(chan struct{})
	var holdOnce, releaseOnce sync.Once
	subscribe := func(member string) {
		sub, err := kafkasub.NewGroupMember(cfg, watermill.NopLogger{}) // Two instances of one consumer.
		require.NoError(t, err)
		t.Cleanup(func() {
			cancel() // First: it lets go of a message still held.
			_ = sub.Close()
		})
		messages, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		go func() {
			for msg := range messages {
				mu.Lock()
				received[member][string(msg.Payload)] = true
				mu.Unlock()
				if member == "busy" {
					holdOnce.Do(func() { close(holding) })
					select {
					case <-release:
					case <-ctx.Done():
					}
				} else {
					releaseOnce.Do(func() { close(release) })
				}
				msg.Ack()
			}
		}()
	}
	publish("before-0")
	subscribe("busy")
	select {
	case <-holding:
	case <-time.After(time.Minute):
		t.Fatal("the first member received no message")
	}
	subscribe("joining")
	select {
	case <-release:
	case <-time.After(time.Minute):
		t.Fatal("the member that joined beside a busy one received no message: its JoinGroup was cut off before the rebalance timeout ran out")
	}
	require.Equal(t, time.Second, cfg.OverwriteSaramaConfig.Net.ReadTimeout, "NewSubscriber changes a copy of the configuration")

	// Published until each member has received one: the busy member, let go, rejoins, and the
	// partitions are split between the two.
	timeout, tick := time.After(time.Minute), time.NewTicker(100*time.Millisecond)
	defer tick.Stop()
	rounds := 0
	for ; !receivedBy("busy", "after-") || !receivedBy("joining", "after-"); rounds++ {
		publish(fmt.Sprintf("after-%d", rounds))
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatal("the members did not both receive messages published after the join")
		}
	}
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		for r := range rounds {
			for p := range partitions {
				if payload := fmt.Sprintf("after-%d/%d", r, p); !received["busy"][payload] && !received["joining"][payload] {
					return false
				}
			}
		}
		return true
	}, time.Minute, 20*time.Millisecond, "every message published after the join is delivered")
}

// newPartitionPublisher creates topic with the given number of partitions and returns a function
// that publishes one message to each, with payload "<prefix>/<partition>".
func newPartitionPublisher(t *testing.T, brokers []string, topic string, partitions int) func(prefix string) {
	t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V2_8_0_0
	c.Producer.Return.Successes = true
	c.Producer.Partitioner = sarama.NewManualPartitioner
	admin, err := sarama.NewClusterAdmin(brokers, c)
	require.NoError(t, err)
	// A replication factor of -1 is the cluster's default, for a real cluster as for kfake.
	require.NoError(t, admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: int32(partitions), ReplicationFactor: -1}, false))
	require.NoError(t, admin.Close())
	producer, err := sarama.NewSyncProducer(brokers, c)
	require.NoError(t, err)
	t.Cleanup(func() { _ = producer.Close() })
	return func(prefix string) {
		t.Helper()
		for p := range partitions {
			record, err := kafka.DefaultMarshaler{}.Marshal(topic, message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "%s/%d", prefix, p)))
			require.NoError(t, err)
			record.Partition = int32(p)
			_, _, err = producer.SendMessage(record)
			require.NoError(t, err)
		}
	}
}
