package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Message is one outbox row on its way to a broker.
type Message struct {
	Topic string
	// Key is the partition key; empty when the message has none.
	Key string
	Msg *message.Message
	// Partition and Offset are where the broker stored the message, for the relay's trace spans:
	// a sink that knows them sets them when Publish succeeds (KafkaSink does); otherwise they stay
	// -1.
	Partition int32
	Offset    int64
}

// Sink is where the relay publishes. The relay opens one ShardPublisher per shard lease it holds and
// closes it when the lease ends; the stability promise is that new methods are only added to
// optional interfaces.
type Sink interface {
	// Open returns the publisher for shard under the lease's fencing token. For Kafka this
	// initialises the shard's transactional producer, which fences the previous owner's.
	Open(ctx context.Context, shard int, token int64) (ShardPublisher, error)
}

// ShardPublisher publishes the messages of one shard, in order.
type ShardPublisher interface {
	// Publish publishes msgs in order; all of them or, where the broker supports it, none of them
	// (a Kafka transaction). It returns an error wrapping ErrFenced when the broker says another
	// owner took over, and a *RejectedError when the broker refused some messages for good.
	Publish(ctx context.Context, msgs []Message) error
	Close() error
}

// ErrFenced means the lease is no longer this relay's: the broker (or the database) saw a newer
// owner. The relay drops the shard at once and never reuses the publisher.
var ErrFenced = errors.New("relay: fenced by a newer lease owner")

// RejectedError lists messages a broker refused for good (too large, invalid): retrying them cannot
// succeed, so the relay moves them to the dead-letter table and publishes the rest.
type RejectedError struct {
	// Rejected maps an index into the published slice to the broker's reason.
	Rejected map[int]error
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("relay: the broker rejected %d message(s) for good", len(e.Rejected))
}

// WatermillSink publishes through any Watermill message.Publisher, for brokers other than Kafka.
// Publishing is not atomic and a Watermill publisher has no fencing: after a takeover a paused relay
// can still publish copies, which the consumers' inbox drops. Messages are published one topic run at
// a time, in order.
type WatermillSink struct {
	Publisher message.Publisher
}

// Open implements Sink.
func (s WatermillSink) Open(context.Context, int, int64) (ShardPublisher, error) {
	if s.Publisher == nil {
		return nil, errors.New("relay: WatermillSink.Publisher is required")
	}
	return watermillShard(s), nil
}

type watermillShard WatermillSink

func (s watermillShard) Publish(_ context.Context, msgs []Message) error {
	for start := 0; start < len(msgs); {
		end := start + 1
		for end < len(msgs) && msgs[end].Topic == msgs[start].Topic {
			end++
		}
		batch := make([]*message.Message, 0, end-start)
		for _, m := range msgs[start:end] {
			batch = append(batch, m.Msg)
		}
		if err := s.Publisher.Publish(msgs[start].Topic, batch...); err != nil {
			return fmt.Errorf("relay: publish to %s: %w", msgs[start].Topic, err)
		}
		start = end
	}
	return nil
}

// Close does not close the shared Watermill publisher: its owner does.
func (watermillShard) Close() error { return nil }
