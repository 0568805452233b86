package relay

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	// duplicates the inbox drops), and a batch goes out in rounds that hold at most one message of
	// each partition key, so that a key's later message is never in flight beside an earlier one
	// that may fail (a key with a backlog is then published one message per round trip). If not
	// specified, defaults to true (see NewKafkaSink).
	Transactional *bool
	// TransactionalIDPrefix prefixes each shard's transactional.id ("<prefix>-shard-<n>"). Relays of
	// one outbox must share it, or a frozen relay's open transaction is not fenced by the new
	// owner's producer; different outboxes on one cluster must not, or their producers fence each
	// other all the time. Printable characters only. If not specified, the relay that runs the sink
	// sets it to "txbox-" and the identity its outbox was given when migrated (migration 00012),
	// which meets both conditions; a sink left so serves the relays of one outbox only.
	TransactionalIDPrefix string
	// Sarama, when set, is the base sarama configuration (TLS, SASL, client id...). txbox overrides
	// the settings its guarantees rest on: idempotence, acks=all, one in-flight request, returned
	// successes, and the transactional id. It is validated by NewKafkaSink.
	Sarama *sarama.Config
	// Marshaler turns Watermill messages into Kafka records. If not specified, watermill-kafka's
	// DefaultMarshaler, so watermill-kafka subscribers read what the relay writes; the record key is
	// set to the message's partition key.
	Marshaler kafka.Marshaler
}

// KafkaSink publishes to Kafka through sarama, in batches.
//
// sarama's calls cannot be cancelled. When the context of Open or Publish ends first (the lease
// ended, or a graceful stop ran out of time), the call is left to finish on its own goroutine and
// its producer is closed when it does; a transaction it had open is aborted, not committed.
type KafkaSink struct {
	cfg           KafkaConfig
	transactional bool

	mu     sync.Mutex
	prefix string // the transactional IDs' prefix: the configured one, or the outbox's (bindOutbox)
}

// NewKafkaSink validates cfg and returns a KafkaSink.
func NewKafkaSink(cfg KafkaConfig) (*KafkaSink, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("relay: KafkaConfig.Brokers is required")
	}
	for _, b := range cfg.Brokers {
		_, port, err := net.SplitHostPort(b)
		if err != nil || port == "" || strings.TrimSpace(b) != b {
			return nil, fmt.Errorf("relay: KafkaConfig.Brokers: %q is not a host:port address", b)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return nil, fmt.Errorf("relay: KafkaConfig.Brokers: %q: the port must be a number from 1 to 65535", b)
		}
	}
	if strings.ContainsFunc(cfg.TransactionalIDPrefix, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return nil, fmt.Errorf("relay: KafkaConfig.TransactionalIDPrefix %q has control characters", cfg.TransactionalIDPrefix)
	}
	if cfg.Marshaler == nil {
		cfg.Marshaler = kafka.DefaultMarshaler{}
	}
	transactional := cfg.Transactional == nil || *cfg.Transactional
	s := &KafkaSink{cfg: cfg, transactional: transactional, prefix: cfg.TransactionalIDPrefix}
	validated := s.saramaConfig(0)
	if validated.Producer.Transaction.ID == "-shard-0" {
		validated.Producer.Transaction.ID = outboxPrefix("unbound") + "-shard-0" // As a relay will set it.
	}
	if err := validated.Validate(); err != nil {
		return nil, fmt.Errorf("relay: KafkaConfig.Sarama: %w", err)
	}
	return s, nil
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
		c.Producer.Transaction.ID = s.transactionalIDPrefix() + "-shard-" + strconv.Itoa(shard)
	}
	return c
}

// transactionTimeout is how long the broker lets a transaction of the sink's producers stay open
// before it aborts it: sarama's default (1m) unless KafkaConfig.Sarama sets it. Versions before
// migration 00012 left it at the default too.
func (s *KafkaSink) transactionTimeout() time.Duration {
	return s.saramaConfig(0).Producer.Transaction.Timeout
}

// outboxPrefix is the transactional IDs' prefix for the outbox whose identity is id.
func outboxPrefix(id string) string { return "txbox-" + id }

// bindOutbox gives a sink whose TransactionalIDPrefix was not specified the prefix of the outbox
// whose relay runs it, and refuses a second outbox, unless it replaces the outbox the sink served
// (replacing, its identity): that one was made anew. It returns the prefix in use.
func (s *KafkaSink) bindOutbox(id, replacing string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.cfg.TransactionalIDPrefix != "":
		return s.prefix, nil
	case s.prefix == "", replacing != "" && s.prefix == outboxPrefix(replacing):
		s.prefix = outboxPrefix(id)
	case s.prefix != outboxPrefix(id):
		return "", errors.New("relay: one KafkaSink without a KafkaConfig.TransactionalIDPrefix serves the relays of two outboxes, " +
			"whose producers would fence each other; give each relay a sink of its own")
	}
	return s.prefix, nil
}

func (s *KafkaSink) transactionalIDPrefix() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.prefix
}

// Check implements Checker: it asks the brokers for the cluster's metadata, as a producer does
// first.
func (s *KafkaSink) Check(ctx context.Context) error {
	_, err := detached(ctx, func() (struct{}, error) {
		client, err := sarama.NewClient(s.cfg.Brokers, s.saramaConfig(0))
		if err != nil {
			return struct{}{}, fmt.Errorf("kafka brokers %s: %w", strings.Join(s.cfg.Brokers, ","), err)
		}
		return struct{}{}, client.Close()
	}, func(struct{}, error) {})
	return err
}

// Open implements Sink. With transactions, creating the producer runs InitProducerId for the
// shard's transactional.id, which bumps the epoch and fences the previous owner.
func (s *KafkaSink) Open(ctx context.Context, shard int, token int64) (ShardPublisher, error) {
	if s.transactional && s.transactionalIDPrefix() == "" {
		return nil, errors.New("relay: KafkaSink opened before a relay gave it its outbox's transactional-ID prefix")
	}
	k, err := detached(ctx, func() (*kafkaShard, error) {
		client, err := sarama.NewClient(s.cfg.Brokers, s.saramaConfig(shard))
		if err != nil {
			return nil, err
		}
		p, err := sarama.NewSyncProducerFromClient(client)
		if err != nil {
			_ = client.Close()
			return nil, err
		}
		return &kafkaShard{sink: s, client: client, producer: p}, nil
	}, func(k *kafkaShard, err error) {
		if err == nil {
			k.close()
		}
	})
	if err != nil {
		if isFenced(err) {
			return nil, fmt.Errorf("%w: %w", ErrFenced, err)
		}
		return nil, fmt.Errorf("relay: kafka producer for shard %d: %w", shard, err)
	}
	return k, nil
}

// fence opens and closes a producer under the transactional ID of each of shards, all at once:
// InitProducerId aborts the transaction left open under the ID, if any, and fences the producer
// that left it.
func (s *KafkaSink) fence(ctx context.Context, shards []int) error {
	errs := make([]error, len(shards))
	var wg sync.WaitGroup
	for i, shard := range shards {
		wg.Go(func() {
			p, err := s.Open(ctx, shard, 0)
			if err == nil {
				err = p.Close()
			}
			errs[i] = err
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

type kafkaShard struct {
	sink     *KafkaSink
	client   sarama.Client
	producer sarama.SyncProducer
	// abandoned is set when a Publish returned before sarama did: the producer is closed by that
	// call's goroutine once sarama returns, and never used again.
	abandoned atomic.Bool
}

func (k *kafkaShard) Publish(ctx context.Context, msgs []Message) error {
	if k.abandoned.Load() {
		return errors.New("relay: kafka producer abandoned by an earlier publish")
	}
	records := make([]*sarama.ProducerMessage, 0, len(msgs))
	rejected := map[int]error{}
	for i, m := range msgs {
		if err := validTopic(m.Topic); err != nil {
			rejected[i] = err
			continue
		}
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
	_, err := detached(ctx, func() (struct{}, error) { return struct{}{}, k.send(ctx, msgs, records) },
		func(struct{}, error) { k.close() })
	if errors.Is(err, errAbandoned) {
		k.abandoned.Store(true)
	}
	return err
}

// send publishes records, one transaction for all of them or, without transactions, in rounds
// that hold at most one record per partition key.
func (k *kafkaShard) send(ctx context.Context, msgs []Message, records []*sarama.ProducerMessage) error {
	if err := k.precheck(records); err != nil {
		return err
	}
	if !k.sink.transactional {
		for i, round := range rounds(msgs, records) {
			if i > 0 && ctx.Err() != nil {
				return context.Cause(ctx) // Abandoned: start no further round.
			}
			if err := k.classify(k.producer.SendMessages(round)); err != nil {
				return err
			}
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
	if ctx.Err() != nil {
		// Whoever waited for this batch has given up on it (the lease ended, or a graceful stop
		// ran out of time): it must not become visible now.
		return k.abort(fmt.Errorf("relay: kafka transaction abandoned: %w", context.Cause(ctx)))
	}
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

// precheck refuses, before any is sent, the records that the client or the cluster's metadata
// already says cannot be published: too large for Producer.MaxMessageBytes, or for a topic that does
// not exist or that the relay may not see. Kept out of a transaction, they never put the producer
// through its error states, which cost a batch and, in sarama 1.61, race on its transaction state.
func (k *kafkaShard) precheck(records []*sarama.ProducerMessage) error {
	rejected, refused := map[int]error{}, map[int]error{}
	topics := map[string]error{}
	limit := k.client.Config().Producer.MaxMessageBytes
	for _, rec := range records {
		i := rec.Metadata.(int)
		if size := rec.ByteSize(2); size > limit {
			rejected[i] = fmt.Errorf("record of %d bytes is too large for Producer.MaxMessageBytes (%d): %w", size, limit, sarama.ErrMessageSizeTooLarge)
			continue
		}
		err, seen := topics[rec.Topic]
		if !seen {
			_, err = k.client.Partitions(rec.Topic)
			topics[rec.Topic] = err
		}
		switch {
		case err == nil:
		case isRefused(err):
			refused[i] = fmt.Errorf("topic %q: %w", rec.Topic, err)
		case isRejected(err):
			rejected[i] = fmt.Errorf("topic %q: %w", rec.Topic, err)
		default:
			return fmt.Errorf("relay: kafka metadata of %q: %w", rec.Topic, err)
		}
	}
	if len(rejected)+len(refused) > 0 {
		return &RejectedError{Rejected: rejected, Refused: refused}
	}
	return nil
}

// rounds splits records (built from msgs, in order) into rounds in which each partition key of a
// topic appears at most once, each round keeping the order of msgs. Sent one round after the other,
// a key's message leaves only once its earlier messages were acknowledged: sarama gives up on a
// record whose request keeps failing and then still sends the later records of its partition, so a
// key's later message in flight beside it would reach Kafka first. Messages without a key have no
// order to keep and all go in the first round.
func rounds(msgs []Message, records []*sarama.ProducerMessage) [][]*sarama.ProducerMessage {
	type topicKey struct{ topic, key string }
	seen := map[topicKey]int{}
	var out [][]*sarama.ProducerMessage
	for _, rec := range records {
		m := msgs[rec.Metadata.(int)]
		r := 0
		if m.Key != "" {
			tk := topicKey{m.Topic, m.Key}
			r = seen[tk]
			seen[tk]++
		}
		if r == len(out) {
			out = append(out, nil)
		}
		out[r] = append(out[r], rec)
	}
	return out
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
		rejected, refused := map[int]error{}, map[int]error{}
		for _, pe := range perrs {
			if isFenced(pe.Err) {
				return fmt.Errorf("%w: %w", ErrFenced, pe.Err)
			}
			i, ok := pe.Msg.Metadata.(int)
			switch {
			case !ok:
			case isRejected(pe.Err):
				rejected[i] = pe.Err
			case isRefused(pe.Err):
				refused[i] = pe.Err
			}
		}
		if len(rejected)+len(refused) > 0 {
			return &RejectedError{Rejected: rejected, Refused: refused}
		}
		return fmt.Errorf("relay: kafka: %w (first: %w)", err, perrs[0].Err)
	}
	return fmt.Errorf("relay: kafka: %w", err)
}

// Close implements ShardPublisher. After an abandoned Publish the producer is closed by that
// publish's goroutine, when sarama returns.
func (k *kafkaShard) Close() error {
	if k.abandoned.Load() {
		return nil
	}
	return k.close()
}

// close closes the producer, then the client it was made from (which the producer leaves open).
func (k *kafkaShard) close() error {
	return errors.Join(k.producer.Close(), k.client.Close())
}

// errAbandoned means a sarama call was left running because its context ended first.
var errAbandoned = errors.New("relay: kafka did not answer in time")

// detached runs f on a goroutine of its own and returns its result, or an error wrapping
// errAbandoned and ctx's cause as soon as ctx ends: sarama's calls cannot be cancelled, and a relay
// must be able to walk away from a broker that does not answer. If ctx ends first, cleanup
// receives f's result when f returns.
func detached[T any](ctx context.Context, f func() (T, error), cleanup func(T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f()
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
		go func() {
			r := <-done
			cleanup(r.v, r.err)
		}()
		var zero T
		return zero, fmt.Errorf("%w: %w", errAbandoned, context.Cause(ctx))
	}
}

func isFenced(err error) bool {
	return errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch)
}

// isRejected says whether a record can never be accepted as it is: retrying it cannot help.
func isRejected(err error) bool {
	var conf sarama.ConfigurationError // sarama's own size check, before sending
	return errors.As(err, &conf) ||
		errors.Is(err, sarama.ErrMessageSizeTooLarge) || errors.Is(err, sarama.ErrInvalidMessage) ||
		errors.Is(err, sarama.ErrInvalidMessageSize) || errors.Is(err, sarama.ErrInvalidTopic) ||
		errors.Is(err, sarama.ErrInvalidRecord) || errors.Is(err, sarama.ErrPolicyViolation)
}

// isRefused says whether the broker refused a record for a reason that may pass: a topic that
// does not exist may be created (and right after creation it is briefly unknown), a missing
// permission may be granted.
func isRefused(err error) bool {
	return errors.Is(err, sarama.ErrUnknownTopicOrPartition) || errors.Is(err, sarama.ErrTopicAuthorizationFailed)
}

// validTopic checks a topic name against Kafka's rules, which no broker relaxes.
func validTopic(topic string) error {
	bad := topic == "" || topic == "." || topic == ".." || len(topic) > 249 ||
		strings.ContainsFunc(topic, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-')
		})
	if bad {
		return fmt.Errorf("invalid Kafka topic name %q (1 to 249 of a-z A-Z 0-9 . _ -): %w", topic, sarama.ErrInvalidTopic)
	}
	return nil
}
