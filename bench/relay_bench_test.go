package bench

import (
	"context"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
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

// BenchmarkRelayIdle measures what a pipeline costs while nothing is written: b.N milliseconds of
// idling after it delivered a first few messages, in CPU milliseconds per second of this process
// (the relay or forwarder, with kfake beside it) and of the PostgreSQL backends of its pool.
//
//   - watermill-forwarder: polling every 10ms, as in BenchmarkLatency.
//   - txbox: the relay with its defaults.
func BenchmarkRelayIdle(b *testing.B) {
	b.Run("watermill-forwarder", func(b *testing.B) {
		o := newWatermillOutbox(b)
		_, stop := o.startForwarder(b, 10*time.Millisecond)
		defer stop()
		measureIdle(b, o.env, func(topic string) { writeInChunks(b, o.env, messages(20, true), 1, o.publish(topic)) })
	})
	b.Run("txbox", func(b *testing.B) {
		o := newTxboxOutbox(b)
		published, stop := startRelay(b, o.env, kafkaSink(b, o.env, true), 0)
		defer stop()
		measureIdle(b, o.env, func(topic string) {
			writeInChunks(b, o.env, messages(20, true), 1, o.publish(topic))
			waitUntil(b, "the relay to publish", time.Minute, func() bool { return published() >= 20 })
		})
	})
}

func measureIdle(b *testing.B, env *txtest.Env, warm func(topic string)) {
	warm(kafkatest.Topic(b))
	time.Sleep(time.Second) // The forwarder's own acks and any back-off settle.
	pids := backendsOf(b, env)
	pgBefore, selfBefore := cpuOf(b, pids), selfCPU()
	b.ResetTimer()
	time.Sleep(time.Duration(b.N) * time.Millisecond)
	b.StopTimer()
	secs := b.Elapsed().Seconds()
	b.ReportMetric(float64(cpuOf(b, pids)-pgBefore)/float64(time.Millisecond)/secs, "pg-cpu-ms/s")
	b.ReportMetric(float64(selfCPU()-selfBefore)/float64(time.Millisecond)/secs, "self-cpu-ms/s")
	b.ReportMetric(0, "ns/op")
}

// backendsOf lists the PostgreSQL backends of env's pool: those of its connections that are idle
// now or at one of a few looks spread over 50ms, which an idle pipeline's are.
func backendsOf(b *testing.B, env *txtest.Env) []int {
	ctx := context.Background()
	seen := map[int]bool{}
	for range 5 {
		for _, c := range env.Pool.AcquireAllIdle(ctx) {
			seen[int(c.Conn().PgConn().PID())] = true
			c.Release()
		}
		time.Sleep(10 * time.Millisecond)
	}
	return slices.Collect(maps.Keys(seen))
}

// cpuOf is the CPU time the processes pids have used, from /proc (PostgreSQL runs on this machine).
func cpuOf(b *testing.B, pids []int) time.Duration {
	var ticks int64
	for _, pid := range pids {
		stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			b.Fatalf("read a PostgreSQL backend's CPU time (is the server on this machine?): %v", err)
		}
		// Fields after the command name, which ends with the last ')': state is field 3, utime 14, stime 15.
		f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+2:]))
		for _, s := range f[11:13] {
			n, _ := strconv.ParseInt(s, 10, 64)
			ticks += n
		}
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
