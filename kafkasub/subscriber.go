package kafkasub

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrTopicShared is Subscriber.Subscribe's error for a topic the subscriber already serves in its
// consumer group.
var ErrTopicShared = errors.New("kafkasub: the topic is already subscribed in this consumer group; give each handler a subscriber of its own, in a consumer group of its own")

// Subscriber is watermill-kafka's subscriber, serving each topic to one subscription (one router
// handler) at a time when it has a consumer group.
//
// Each Subscribe call of watermill-kafka's subscriber joins its consumer group as one more
// member, and Kafka splits a topic's partitions among a group's members: two router handlers
// given one subscriber would each receive only part of the topic, and commit the offsets of the
// rest for the other, so each would miss the other's messages without an error. The inbox keeps
// one memory per handler, so every handler needs every message: give each its own Subscriber in a
// group of its own (for example "billing.debit" and "billing.email"). This one refuses the second
// subscription instead, so the mistake stops the router at start-up.
type Subscriber struct {
	*kafka.Subscriber
	group string

	mu     sync.Mutex
	topics map[string]bool
}

// NewSubscriber returns a watermill-kafka subscriber for cfg (see SubscriberConfig) that refuses a
// second subscription to a topic in its consumer group. With a consumer group, it raises the read
// timeout of cfg's sarama configuration to 5 s more than its rebalance timeout when it is shorter
// (see SaramaConfig); cfg's own configuration is left as it is.
func NewSubscriber(cfg kafka.SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if cfg.ConsumerGroup != "" {
		// Raised rather than refused, as the relay's KafkaSink overrides the producer settings its
		// guarantees rest on: a read timeout shorter than that is never right for a JoinGroup
		// (Kafka's Java client waits at least that long for one, whatever its request timeout),
		// and refusing it would refuse sarama's own defaults, 30 s read and 60 s rebalance
		// timeout, which every configuration built on sarama.NewConfig or watermill-kafka's
		// default carries. The cost: sarama has one read timeout for every request, so a broker
		// that stops answering any of them is given up on only after that long.
		sc := kafka.DefaultSaramaSubscriberConfig() // What watermill-kafka uses when cfg has none.
		if cfg.OverwriteSaramaConfig != nil {
			copied := *cfg.OverwriteSaramaConfig
			sc = &copied
		}
		sc.Net.ReadTimeout = max(sc.Net.ReadTimeout, joinGroupReadTimeout(sc))
		cfg.OverwriteSaramaConfig = sc
	}
	sub, err := kafka.NewSubscriber(cfg, logger)
	if err != nil {
		return nil, err
	}
	return &Subscriber{Subscriber: sub, group: cfg.ConsumerGroup, topics: map[string]bool{}}, nil
}

// Subscribe subscribes to topic until ctx is done. Its error wraps ErrTopicShared when the
// subscriber already serves topic in a consumer group.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if s.group == "" {
		return s.Subscriber.Subscribe(ctx, topic) // Without a group, every subscription reads every partition.
	}
	s.mu.Lock()
	taken := s.topics[topic]
	s.topics[topic] = true
	s.mu.Unlock()
	if taken {
		return nil, fmt.Errorf("%w (topic %q, consumer group %q)", ErrTopicShared, topic, s.group)
	}
	messages, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		s.release(topic)
		return nil, err
	}
	context.AfterFunc(ctx, func() { s.release(topic) })
	return messages, nil
}

func (s *Subscriber) release(topic string) {
	s.mu.Lock()
	delete(s.topics, topic)
	s.mu.Unlock()
}
