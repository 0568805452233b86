// Package kafkasub configures watermill-kafka subscribers for services that consume what the txbox
// relay publishes, and tells the inbox where a delivered message came from.
//
// It is a package of its own so that importing the inbox or the outbox never pulls a Kafka client
// into a program: only the program that builds a Kafka subscriber imports this one.
package kafkasub

import (
	"context"

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
//   - protocol version 2.8, the oldest one with the transactional features the relay uses.
//
// Change other settings (TLS, SASL, timeouts) on the returned value.
func SaramaConfig() *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig()
	if !c.Version.IsAtLeast(sarama.V2_8_0_0) {
		c.Version = sarama.V2_8_0_0
	}
	c.Consumer.IsolationLevel = sarama.ReadCommitted
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	return c
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
