package kafkasub

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrTopicShared is Subscriber.Subscribe's error for a topic that a subscriber of this process
// already serves in the same consumer group of the same cluster.
var ErrTopicShared = errors.New("kafkasub: the topic is already subscribed in this consumer group; give each handler a subscriber of its own, in a consumer group of its own")

// Subscriber is watermill-kafka's subscriber, serving each topic of its consumer group to one
// subscription (one router handler) at a time in the process.
//
// Each Subscribe call of watermill-kafka's subscriber joins its consumer group as one more
// member, and Kafka splits a topic's partitions among a group's members: two router handlers
// subscribed in one group, through one subscriber or one each, would each receive only part of the
// topic, and commit the offsets of the rest for the other, so each would miss the other's messages
// without an error. The inbox keeps one memory per handler, so every handler needs every message:
// give each its own Subscriber in a group of its own (for example "billing.debit" and
// "billing.email"). Subscribers of this package refuse the second subscription instead, so the
// mistake stops the router at start-up. Other processes in the group are its other instances, and
// share the partitions as Kafka means them to.
type Subscriber struct {
	*kafka.Subscriber
	cluster, group string
	member         string // NewGroupMember's: this subscriber's own name in subscribed; "" otherwise
}

// subscribed holds every subscription of this process's Subscribers by (cluster, group, topic,
// member): another one in the same group would split the topic's partitions with it. A hold whose
// context is done is free, though its release (context.AfterFunc) may not have run yet, so a
// consumer subscribing again at once after it cancelled the last subscription is not refused.
var subscribed = struct {
	sync.Mutex
	by           map[[4]string]hold
	subs, grants int // counters naming members and holds
}{by: map[[4]string]hold{}}

// hold is one subscription in subscribed.
type hold struct {
	sub   *Subscriber
	ctx   context.Context
	grant int // tells this hold from a later one of the same key
}

// NewSubscriber returns a watermill-kafka subscriber for cfg (see SubscriberConfig) that refuses a
// subscription to a topic that a subscriber of this process already serves in its consumer group.
// It reads with a copy of cfg's sarama configuration (watermill-kafka's default when cfg has none;
// cfg's own is left as it is) in which the settings txbox's guarantees rest on are set as
// SaramaConfig sets them: isolation level read_committed, a new group (or one whose committed
// offsets expired) starting at the oldest offset, and, with a consumer group, a read timeout at
// least 5 s more than the rebalance timeout.
func NewSubscriber(cfg kafka.SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	cfg.OverwriteSaramaConfig = guaranteed(cfg.OverwriteSaramaConfig, cfg.ConsumerGroup != "")
	sub, err := kafka.NewSubscriber(cfg, logger)
	if err != nil {
		return nil, err
	}
	brokers := slices.Sorted(slices.Values(cfg.Brokers))
	return &Subscriber{Subscriber: sub, cluster: strings.Join(brokers, ","), group: cfg.ConsumerGroup}, nil
}

// NewGroupMember is NewSubscriber for one more member of a consumer group that other subscribers
// of this process serve too: several instances of one consumer, the same handlers, in one process
// (a test of how its instances share a group's partitions, say). It still refuses a second
// subscription to a topic of its own. Never give two different handlers members of one group:
// each would process only the partitions Kafka gives it.
func NewGroupMember(cfg kafka.SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	s, err := NewSubscriber(cfg, logger)
	if err != nil {
		return nil, err
	}
	subscribed.Lock()
	subscribed.subs++
	s.member = strconv.Itoa(subscribed.subs)
	subscribed.Unlock()
	return s, nil
}

// guaranteed returns a copy of sc, or of watermill-kafka's default when sc is nil, with the
// consumer settings SaramaConfig sets for txbox's guarantees.
//
// They are set rather than refused, as the relay's KafkaSink sets the producer settings its
// guarantees rest on: sarama.NewConfig's defaults, which every configuration built on it or on
// watermill-kafka's default carries unless changed, are read_uncommitted, the newest offset and
// 30 s read against a 60 s rebalance timeout, and none is right for a consumer of the relay.
// Read uncommitted, a consumer sees the batch of a relay that lost its lease, an aborted Kafka
// transaction. From the newest offset, a new group skips every message published before it first
// joined, and a group whose committed offsets expired (the broker's offsets.retention.minutes,
// while its consumers were down) skips everything published since, without an error; from the
// oldest, the inbox drops what was processed already. A read timeout shorter than the rebalance
// timeout + 5 s cuts off a JoinGroup the broker may hold that long (Kafka's Java client waits at
// least that long for one, whatever its request timeout); the cost is that sarama has one read
// timeout for every request, so a broker that stops answering any of them is given up on only
// after that long.
func guaranteed(sc *sarama.Config, group bool) *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig() // What watermill-kafka uses when cfg has none.
	if sc != nil {
		copied := *sc
		c = &copied
	}
	c.Consumer.IsolationLevel = sarama.ReadCommitted
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	if group {
		c.Net.ReadTimeout = max(c.Net.ReadTimeout, joinGroupReadTimeout(c))
	}
	return c
}

// Subscribe subscribes to topic until ctx is done or the subscriber is closed. Its error wraps
// ErrTopicShared when a subscriber of this process already serves topic in the same consumer group
// of the same brokers.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if s.group == "" {
		return s.Subscriber.Subscribe(ctx, topic) // Without a group, every subscription reads every partition.
	}
	key := [4]string{s.cluster, s.group, topic, s.member}
	subscribed.Lock()
	if h, ok := subscribed.by[key]; ok && h.ctx.Err() == nil {
		subscribed.Unlock()
		return nil, fmt.Errorf("%w (topic %q, consumer group %q)", ErrTopicShared, topic, s.group)
	}
	subscribed.grants++
	grant := subscribed.grants
	subscribed.by[key] = hold{sub: s, ctx: ctx, grant: grant}
	subscribed.Unlock()
	mine := func(k [4]string, h hold) bool { return k == key && h.grant == grant }
	messages, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		release(mine)
		return nil, err
	}
	context.AfterFunc(ctx, func() { release(mine) })
	return messages, nil
}

// Close closes the subscriber and ends its subscriptions, whose topics other subscribers of its
// group may then take.
func (s *Subscriber) Close() error {
	err := s.Subscriber.Close()
	release(func(_ [4]string, h hold) bool { return h.sub == s })
	return err
}

// release frees the holds that match: a subscription's own, never a later one of its key.
func release(match func([4]string, hold) bool) {
	subscribed.Lock()
	defer subscribed.Unlock()
	maps.DeleteFunc(subscribed.by, match)
}
