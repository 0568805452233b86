package kafkasub_test

import (
	"context"
	"sync"
	"testing"
	"time"

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

	shared := newSubscriber(group + ".shared")
	router, err = message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	for _, name := range []string{"debit", "email"} {
		router.AddConsumerHandler(name, topic, shared, func(*message.Message) error { return nil })
	}
	sharedCtx, stop := context.WithTimeout(context.Background(), time.Minute)
	defer stop()
	require.ErrorIs(t, router.Run(sharedCtx), kafkasub.ErrTopicShared)
}
