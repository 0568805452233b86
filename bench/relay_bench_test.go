package bench

import (
	"context"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// BenchmarkRelayWarmDrain measures the relay alone, its producers already open: the time from the
// commit of a backlog of b.N messages, written in one transaction, until the relay has published
// and completed them all.
//
//   - sarama-idempotent: the ceiling, an idempotent sarama producer sending the same records
//     (watermill-kafka's wire format, keyed) in batches of relay.DefaultBatchSize, nothing read
//     from PostgreSQL.
//   - txbox-transactional: the relay with its defaults.
func BenchmarkRelayWarmDrain(b *testing.B) {
	b.Run("sarama-idempotent", func(b *testing.B) {
		c := sarama.NewConfig()
		c.Version = sarama.V2_8_0_0
		c.Producer.Idempotent = true
		c.Producer.RequiredAcks = sarama.WaitForAll
		c.Producer.Return.Successes = true
		c.Net.MaxOpenRequests = 1
		p, err := sarama.NewSyncProducer(kafkatest.Brokers(b), c)
		if err != nil {
			b.Fatal(err)
		}
		defer p.Close()
		topic := kafkatest.Topic(b)
		msgs := messages(b.N, true)
		records := make([]*sarama.ProducerMessage, len(msgs))
		for i, m := range msgs {
			if records[i], err = (kafka.DefaultMarshaler{}).Marshal(topic, m); err != nil {
				b.Fatal(err)
			}
			records[i].Key = sarama.StringEncoder(m.Metadata.Get(outbox.PartitionKeyMetadata))
		}
		if err := p.SendMessages(records[:1]); err != nil { // Metadata and producer id.
			b.Fatal(err)
		}
		b.ResetTimer()
		for start := 0; start < len(records); start += relay.DefaultBatchSize {
			if err := p.SendMessages(records[start:min(start+relay.DefaultBatchSize, len(records))]); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		reportRate(b, b.N)
	})
	b.Run("txbox-transactional", func(b *testing.B) {
		o := newTxboxOutbox(b)
		topic := kafkatest.Topic(b)
		published, stop := startRelay(b, o.env, kafkaSink(b, o.env, true), 0)
		defer stop()
		warm := messages(200, true)
		writeInChunks(b, o.env, warm, len(warm), o.publish(topic))
		waitUntil(b, "the relay to open its producers", time.Minute, func() bool { return published() >= len(warm) })

		msgs := messages(b.N, true)
		ctx := context.Background()
		tx, err := o.env.Pool.Begin(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		for start := 0; start < len(msgs); start += prefillChunk {
			if err := o.publish(topic)(tx, msgs[start:min(start+prefillChunk, len(msgs))]); err != nil {
				b.Fatal(err)
			}
		}
		b.ResetTimer()
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
		waitUntil(b, "the relay to drain the backlog", drainTimeout, func() bool { return published() >= len(warm)+b.N })
		b.StopTimer()
		requireRecords(b, topic, len(warm)+b.N)
		reportRate(b, b.N)
	})
}

// BenchmarkRelayLatency is BenchmarkLatency's txbox variant with the relay's default settings
// rather than a 10ms poll, which is what a user who sets nothing gets.
func BenchmarkRelayLatency(b *testing.B) {
	o := newTxboxOutbox(b)
	_, stop := startRelay(b, o.env, kafkaSink(b, o.env, true), 0)
	defer stop()
	topic := kafkatest.Topic(b)
	measureLatency(b, o.env, o.publish(topic), topic)
}
