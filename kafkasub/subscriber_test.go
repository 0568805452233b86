package kafkasub_test

import (
	"context"
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

// Two handlers of one router on one topic, each with a subscriber of its own in a group of its
// own, each receive every message of the topic's partitions; one subscriber shared by both is
// refused when the router starts, rather than splitting the partitions between them.
func TestEveryHandlerOfATopicNeedsASubscriberOfItsOwn(t *testing.T) {
	t.Parallel()
	brokers, topic := kafkatest.Brokers(t), kafkatest.Topic(t)
	group := "billing-" + watermill.NewShortUUID()
	logger := watermill.NopLogger{}

	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}}, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	const n = 30
	for i := range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte{byte(i)})
		require.NoError(t, pub.Publish(topic, msg))
	}

	newSubscriber := func(group string) *kafkasub.Subscriber {
		sub, err := kafkasub.NewSubscriber(kafkatest.SubscriberConfig(brokers, group), logger)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		return sub
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	var mu sync.Mutex
	seen := map[string]map[string]bool{"debit": {}, "email": {}}
	for name := range seen {
		router.AddConsumerHandler(name, topic, newSubscriber(group+"."+name), func(msg *message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			seen[name][msg.UUID] = true
			return nil
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen["debit"]) == n && len(seen["email"]) == n
	}, time.Minute, 20*time.Millisecond, "every handler receives every message")

	// One subscriber for both handlers, or one each in the same group: either way the group's
	// members would split the partitions.
	shared := newSubscriber(group + ".shared")
	for what, subscribers := range map[string][2]*kafkasub.Subscriber{
		"one subscriber":           {shared, shared},
		"a subscriber for each":    {newSubscriber(group + ".each"), newSubscriber(group + ".each")},
		"the first router's group": {newSubscriber(group + ".debit"), newSubscriber(group + ".other")},
	} {
		router, err = message.NewRouter(message.RouterConfig{}, logger)
		require.NoError(t, err)
		for i, name := range []string{"debit", "email"} {
			router.AddConsumerHandler(name, topic, subscribers[i], func(*message.Message) error { return nil })
		}
		sharedCtx, stop := context.WithTimeout(context.Background(), time.Minute)
		require.ErrorIs(t, router.Run(sharedCtx), kafkasub.ErrTopicShared, what)
		stop()
	}
}

// A subscriber that is closed gives its topics up: a consumer made again in the same process (a
// restart of its router) subscribes in the same group.
func TestAClosedSubscriberGivesItsTopicUp(t *testing.T) {
	t.Parallel()
	cfg, topic := newGroup(t)
	first, err := kafkasub.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	_, err = first.Subscribe(context.Background(), topic) // A context that never ends.
	require.NoError(t, err)
	second, err := kafkasub.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = second.Close() })
	_, err = second.Subscribe(context.Background(), topic)
	require.ErrorIs(t, err, kafkasub.ErrTopicShared, "while the first is open")
	require.NoError(t, first.Close())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err = second.Subscribe(ctx, topic)
	require.NoError(t, err, "once the first is closed")
}

// A subscriber built from a configuration that carries none of txbox's consumer settings (here
// watermill-kafka's default, as with kafka.SubscriberConfig{Brokers, ConsumerGroup, Unmarshaler})
// still reads committed messages only, and a new group starts at the oldest offset: it receives
// what was published before it first joined, and not the batch of an aborted Kafka transaction (a
// relay that lost its lease). With sarama's defaults it would start at the newest offset and
// receive neither.
func TestASubscriberWithoutTxboxSettingsReadsCommittedMessagesFromTheOldest(t *testing.T) {
	t.Parallel()
	brokers, topic := kafkatest.Brokers(t), kafkatest.Topic(t)
	publish := newPartitionPublisher(t, brokers, topic, 1)

	zombie, err := sarama.NewSyncProducer(brokers, kafkatest.TransactionalProducer(topic+"-zombie"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = zombie.Close() })
	require.NoError(t, zombie.BeginTxn())
	aborted, err := kafka.DefaultMarshaler{}.Marshal(topic, message.NewMessage(watermill.NewUUID(), []byte("aborted")))
	require.NoError(t, err)
	_, _, err = zombie.SendMessage(aborted)
	require.NoError(t, err)
	require.NoError(t, zombie.AbortTxn())
	publish("committed") // after the aborted batch, in the same partition

	sub, err := kafkasub.NewSubscriber(kafka.SubscriberConfig{
		Brokers: brokers, ConsumerGroup: "plain-" + watermill.NewShortUUID(), Unmarshaler: kafka.DefaultMarshaler{},
	}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	messages, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	select {
	case msg := <-messages:
		require.Equal(t, "committed/0", string(msg.Payload), "the first message read is the committed one")
		msg.Ack()
	case <-ctx.Done():
		t.Fatal("the message published before the group joined was not delivered")
	}
}

// Members made with NewGroupMember join one group beside each other in one process, as instances
// of one consumer do across processes; each still refuses a second subscription of its own.
func TestGroupMembersShareAGroupInOneProcess(t *testing.T) {
	t.Parallel()
	cfg, topic := newGroup(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range 2 {
		member, err := kafkasub.NewGroupMember(cfg, watermill.NopLogger{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = member.Close() })
		_, err = member.Subscribe(ctx, topic)
		require.NoError(t, err)
		_, err = member.Subscribe(ctx, topic)
		require.ErrorIs(t, err, kafkasub.ErrTopicShared)
	}
}

// A subscription whose context ended gives its topic up at once, before its release runs: a
// consumer that cancels its subscription and subscribes again straight away, with the same
// subscriber or a new one, is not refused.
func TestASubscriptionWhoseContextEndedGivesItsTopicUpAtOnce(t *testing.T) {
	t.Parallel()
	cfg, topic := newGroup(t)
	sub, err := kafkasub.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	for i := range 20 {
		ctx, cancel := context.WithCancel(context.Background())
		_, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err, "round %d", i)
		cancel()
		if i%2 == 1 { // Every other round, a new subscriber takes over, the old one left open.
			t.Cleanup(func() { _ = sub.Close() })
			sub, err = kafkasub.NewSubscriber(cfg, watermill.NopLogger{})
			require.NoError(t, err)
		}
	}
	require.NoError(t, sub.Close())
}

// newGroup returns the configuration of a consumer group of its own on the test cluster, and a
// topic of the test's.
func newGroup(t *testing.T) (kafka.SubscriberConfig, string) {
	t.Helper()
	return kafkatest.SubscriberConfig(kafkatest.Brokers(t), "billing-"+watermill.NewShortUUID()), kafkatest.Topic(t)
}
