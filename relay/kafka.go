package relay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/txbox/txbox/internal/failpoint"
)

// KafkaConfig configures a KafkaSink.
type KafkaConfig struct {
	// Brokers to connect to. Required.
	Brokers []string
	// Transactional makes each batch one Kafka transaction through a per-shard transactional
	// producer, whose initialisation by a new lease owner fences the old owner's producer. Consumers
	// must read with isolation level read_committed. If false, the producer is only idempotent:
	// batches are not atomic and a relay that lost its lease can still publish (its copies are
	// duplicates the inbox drops). If not specified, defaults to true (see NewKafkaSink).
	Transactional *bool
	// TransactionalIDPrefix prefixes each shard's transactional.id ("<prefix>-shard-<n>"). Relays of
	// one outbox must share it; different outboxes on one cluster must not. If not specified,
	// defaults to "txbox".
	TransactionalIDPrefix string
	// Sarama, when set, is the base sarama configuration (TLS, SASL, client id...). txbox overrides
	// the settings its guarantees rest on: idempotence, acks=all, one in-flight request, returned
	// successes, and the transactional id.
	Sarama *sarama.Config
	// Marshaler turns Watermill messages into Kafka records. If not specified, watermill-kafka's
	// DefaultMarshaler, so watermill-kafka subscribers read what the relay writes; the record key is
	// set to the message's partition key.
	Marshaler kafka.Marshaler
}

// KafkaSink publishes to Kafka through sarama, in batches.
type KafkaSink struct {
	cfg           KafkaConfig
	transactional bool
}

// NewKafkaSink validates cfg and returns a KafkaSink.
func NewKafkaSink(cfg KafkaConfig) (*KafkaSink, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("relay: KafkaConfig.Brokers is required")
	}
	if cfg.TransactionalIDPrefix == "" {
		cfg.TransactionalIDPrefix = "txbox"
	}
	if cfg.Marshaler == nil {
		cfg.Marshaler = kafka.DefaultMarshaler{}
	}
	transactional := cfg.Transactional == nil || *cfg.Transactional
	return &KafkaSink{cfg: cfg, transactional: transactional}, nil
}

func (s *KafkaSink) saramaConfig(shard int) *sarama.Config {
	c := sarama.NewConfig()
	if s.cfg.Sarama != nil {
		copied := *s.cfg.Sarama
		c = &copied
	}
	if !c.Version.IsAtLeast(sarama.V2_8_0_0) {
		c.Version = sarama.V2_8_0_0
	}
	c.Producer.Idempotent = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Return.Successes = true
	c.Producer.Return.Errors = true
	c.Net.MaxOpenRequests = 1
	if c.Producer.Retry.Max < 5 {
		c.Producer.Retry.Max = 5
	}
	if c.Metadata.Retry.Backoff > 250*time.Millisecond || c.Metadata.Retry.Backoff == 0 {
		c.Metadata.Retry.Backoff = 100 * time.Millisecond
	}
	if s.transactional {
		c.Producer.Transaction.ID = s.cfg.TransactionalIDPrefix + "-shard-" + strconv.Itoa(shard)
	}
	return c
}

// Open implements Sink. With transactions, creating the producer runs InitProducerId for the
// shard's transactional.id, which bumps the epoch and fences the previous owner.
func (s *KafkaSink) Open(_ context.Context, shard int, token int64) (ShardPublisher, error) {
	p, err := sarama.NewSyncProducer(s.cfg.Brokers, s.saramaConfig(shard))
	if err != nil {
		if isFenced(err) {
			return nil, fmt.Errorf("%w: %w", ErrFenced, err)
		}
		return nil, fmt.Errorf("relay: kafka producer for shard %d: %w", shard, err)
	}
	return &kafkaShard{sink: s, producer: p}, nil
}

type kafkaShard struct {
	sink     *KafkaSink
	producer sarama.SyncProducer
}

func (k *kafkaShard) Publish(ctx context.Context, msgs []Message) error {
	records := make([]*sarama.ProducerMessage, 0, len(msgs))
	rejected := map[int]error{}
	for i, m := range msgs {
		rec, err := k.sink.cfg.Marshaler.Marshal(m.Topic, m.Msg)
		if err != nil {
			rejected[i] = fmt.Errorf("marshal: %w", err)
			continue
		}
		if m.Key != "" {
			rec.Key = sarama.StringEncoder(m.Key)
		}
		rec.Metadata = i
		records = append(records, rec)
	}
	if len(rejected) > 0 {
		return &RejectedError{Rejected: rejected}
	}
	if !k.sink.transactional {
		if err := k.producer.SendMessages(records); err != nil {
			return k.classify(err)
		}
		placed(msgs, records)
		return nil
	}
	if err := k.producer.BeginTxn(); err != nil {
		return k.classify(err)
	}
	if err := k.producer.SendMessages(records); err != nil {
		return k.abort(k.classify(err))
	}
	failpoint.HitContext(ctx, "kafka.before-commit")
	if err := k.producer.CommitTxn(); err != nil {
		return k.abort(k.classify(err))
	}
	placed(msgs, records)
	return nil
}

// placed copies where the broker stored each record into the message it came from.
func placed(msgs []Message, records []*sarama.ProducerMessage) {
	for _, rec := range records {
		if i, ok := rec.Metadata.(int); ok {
			msgs[i].Partition, msgs[i].Offset = rec.Partition, rec.Offset
		}
	}
}

// abort ends a failed transaction so the producer can be used again; when the abort itself says
// the producer was fenced, that is the answer.
func (k *kafkaShard) abort(cause error) error {
	if errors.Is(cause, ErrFenced) {
		return cause
	}
	if k.producer.TxnStatus()&sarama.ProducerTxnFlagInTransaction == 0 &&
		k.producer.TxnStatus()&sarama.ProducerTxnFlagAbortableError == 0 {
		return cause
	}
	if err := k.producer.AbortTxn(); err != nil {
		if isFenced(err) {
			return fmt.Errorf("%w: %w", ErrFenced, err)
		}
		return fmt.Errorf("%w (and the abort failed: %w)", cause, err)
	}
	return cause
}

// classify turns sarama's errors into ErrFenced and RejectedError where they mean that.
func (k *kafkaShard) classify(err error) error {
	if err == nil {
		return nil
	}
	if isFenced(err) {
		return fmt.Errorf("%w: %w", ErrFenced, err)
	}
	var perrs sarama.ProducerErrors
	if errors.As(err, &perrs) {
		rejected := map[int]error{}
		for _, pe := range perrs {
			if isFenced(pe.Err) {
				return fmt.Errorf("%w: %w", ErrFenced, pe.Err)
			}
			if isPermanent(pe.Err) {
				if i, ok := pe.Msg.Metadata.(int); ok {
					rejected[i] = pe.Err
				}
			}
		}
		if len(rejected) > 0 {
			return &RejectedError{Rejected: rejected}
		}
		return fmt.Errorf("relay: kafka: %w (first: %w)", err, perrs[0].Err)
	}
	return fmt.Errorf("relay: kafka: %w", err)
}

func (k *kafkaShard) Close() error { return k.producer.Close() }

func isFenced(err error) bool {
	return errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch)
}

// isPermanent says whether the broker refused a record for good.
func isPermanent(err error) bool {
	return errors.Is(err, sarama.ErrMessageSizeTooLarge) || errors.Is(err, sarama.ErrInvalidMessage) ||
		errors.Is(err, sarama.ErrInvalidMessageSize)
}
