package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txbox/txbox/outbox"
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

// Checker is an optional interface of a Sink that can tell whether its broker answers. A relay
// whose sink has it takes no lease, and does not count itself among the relays sharing the shards,
// until Check succeeds: a relay that cannot reach the broker (a wrong address) leaves the shards to
// the relays that can, instead of holding some and publishing nothing. KafkaSink has it.
type Checker interface {
	// Check returns nil once the broker answered, or why it did not.
	Check(ctx context.Context) error
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

// Reasons the relay records with the dead letters of messages it could not publish; stable, for
// filtering and alerting.
const (
	// ReasonRejected: the broker (or the sink, before sending) can never accept the message as it
	// is: a record too large, an invalid record, an invalid topic name.
	ReasonRejected = "rejected by broker"
	// ReasonPublishAttemptsExhausted: the broker refused the message Config.MaxPublishAttempts times
	// for a reason that may pass but did not (the topic does not exist, the relay may not write
	// to it). Fix the cause, then redrive the letter.
	ReasonPublishAttemptsExhausted = "publish attempts exhausted"
	// ReasonBuried: an operator moved the row to the dead-letter table (Admin.Bury); the letter's
	// error holds the operator's note. Package retention matches it by value: such a message may
	// have been published as it was buried, so its letter keeps consumers' inbox rows.
	ReasonBuried = "buried by operator"
)

// RejectedError lists messages a broker refused. The relay trusts the list only for a batch of one
// message: brokers refuse batches as a whole (a Kafka transaction aborts, a record batch too large
// fails with every record in it, an authorization failure is reported against every record of the
// transaction), so for a larger batch it publishes smaller ones until the refused message is
// published alone.
type RejectedError struct {
	// Rejected maps an index into the published slice to the reason, for messages that can never
	// be accepted as they are (a record too large, an invalid record or topic name): the relay moves
	// them to the dead-letter table at once and publishes the rest.
	Rejected map[int]error
	// Refused maps an index to the reason, for messages refused for a reason that may pass (the
	// topic does not exist yet, the relay may not write to it): the relay tries them again with
	// backoff, holding back the later messages of their partition key only, and moves them to the
	// dead-letter table after Config.MaxPublishAttempts.
	Refused map[int]error
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("relay: the broker refused %d message(s), %d of them for good", len(e.Rejected)+len(e.Refused), len(e.Rejected))
}

// cause returns the reason the message at index i was refused, and whether it is refused for good.
func (e *RejectedError) cause(i int) (err error, permanent bool) {
	if err := e.Rejected[i]; err != nil {
		return err, true
	}
	return e.Refused[i], false
}

// KeyRouting says how a WatermillSink's publisher keeps the messages of one partition key in order.
type KeyRouting int

const (
	_ KeyRouting = iota
	// RoutesByPartitionKey declares that the publisher routes every message by its partition key,
	// which the relay hands it in the metadata key outbox.PartitionKeyMetadata: all messages with one
	// key go to one ordered stream (a Kafka partition, an ordering key, a subject), so per-key order
	// holds. For watermill-kafka, use kafka.NewWithPartitioningMarshaler(relay.PartitionKey).
	RoutesByPartitionKey
	// Unordered declares that the publisher ignores the key: consumers may see one key's messages
	// in any order.
	Unordered
)

// PartitionKey returns the partition key the relay hands a Watermill publisher with each message
// (outbox.PartitionKeyMetadata); its signature is watermill-kafka's GeneratePartitionKey, for
// kafka.NewWithPartitioningMarshaler.
func PartitionKey(_ string, msg *message.Message) (string, error) {
	return msg.Metadata.Get(outbox.PartitionKeyMetadata), nil
}

// WatermillSink publishes through any Watermill message.Publisher, for brokers other than Kafka.
// Publishing is not atomic and a Watermill publisher has no fencing: after a takeover a paused relay
// can still publish copies, which the consumers' inbox drops. Messages are published one topic run at
// a time, in order. Whether one key's messages stay in order depends on how the publisher routes
// them, which the sink cannot see: KeyRouting must say.
type WatermillSink struct {
	// Publisher publishes the messages. Required; the sink never closes it.
	Publisher message.Publisher
	// KeyRouting states how Publisher treats partition keys. Required: RoutesByPartitionKey, or
	// Unordered to accept that one key's messages may be consumed out of order.
	KeyRouting KeyRouting
}

func (s WatermillSink) validate() error {
	if s.Publisher == nil {
		return errors.New("relay: WatermillSink.Publisher is required")
	}
	if s.KeyRouting != RoutesByPartitionKey && s.KeyRouting != Unordered {
		return errors.New("relay: WatermillSink.KeyRouting is required: RoutesByPartitionKey (configure the publisher to route by " +
			"outbox.PartitionKeyMetadata, e.g. watermill-kafka's kafka.NewWithPartitioningMarshaler(relay.PartitionKey)) or Unordered")
	}
	return nil
}

// Open implements Sink.
func (s WatermillSink) Open(context.Context, int, int64) (ShardPublisher, error) {
	if err := s.validate(); err != nil {
		return nil, err
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
