// Package kafkasub configures watermill-kafka subscribers for services that consume what the txbox
// relay publishes, and tells the inbox where a delivered message came from.
//
// It is a package of its own so that importing the inbox or the outbox never pulls a Kafka client
// into a program: only the program that builds a Kafka subscriber imports this one.
package kafkasub

import (
	"context"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
)

// SaramaConfig returns the sarama consumer settings txbox's guarantees rest on, on top of
// watermill-kafka's defaults:
//
//   - isolation level read_committed, so the batch of a relay that lost its lease (an aborted
//     Kafka transaction) is never seen;
//   - a new consumer group starts at the oldest offset, so messages published before the group
//     first joined are not skipped;
//   - protocol version 2.8, the oldest one with the transactional features the relay uses;
//   - a read timeout (Net.ReadTimeout) 5 s longer than the rebalance timeout
//     (Consumer.Group.Rebalance.Timeout): 65 s, where sarama's default is 30 s. The broker holds a
//     member's JoinGroup until every member has rejoined, for up to the rebalance timeout (60 s), and
//     a member handling a message rejoins only once the message is acknowledged. A read timeout
//     shorter than that cuts the JoinGroup off and the member joins again, and again: the group
//     can go on rebalancing for good, its members receiving nothing (IBM/sarama#2820). Kafka's
//     Java client waits rebalance timeout + 5 s for a JoinGroup for this reason; sarama has one
//     read timeout for every request.
//
// Change other settings (TLS, SASL, timeouts) on the returned value. NewSubscriber sets the isolation
// level and the initial offset back, and raises a read timeout a change left shorter than the
// rebalance timeout + 5 s.
func SaramaConfig() *sarama.Config {
	c := guaranteed(nil, true)
	if !c.Version.IsAtLeast(sarama.V2_8_0_0) {
		c.Version = sarama.V2_8_0_0
	}
	return c
}

// joinGroupReadTimeout is the shortest read timeout that lets a JoinGroup be answered: the broker
// may hold it for the group's rebalance timeout, and the margin is the one Kafka's Java client gives
// a JoinGroup above it.
func joinGroupReadTimeout(c *sarama.Config) time.Duration {
	return c.Consumer.Group.Rebalance.Timeout + 5*time.Second
}

// SubscriberConfig returns a watermill-kafka subscriber configuration for consumer group
// consumerGroup with SaramaConfig's settings and watermill-kafka's default unmarshaler, which reads
// the records the relay writes.
func SubscriberConfig(brokers []string, consumerGroup string) kafka.SubscriberConfig {
	return kafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: SaramaConfig(),
		ConsumerGroup:         consumerGroup,
	}
}

// Delivery returns the partition and offset that watermill-kafka's subscriber delivered a message
// from, read from the message's context. Give it to the inbox as inbox.Config.Delivery.
func Delivery(ctx context.Context) (partition int32, offset int64, ok bool) {
	partition, okPartition := kafka.MessagePartitionFromCtx(ctx)
	offset, okOffset := kafka.MessagePartitionOffsetFromCtx(ctx)
	return partition, offset, okPartition && okOffset
}
