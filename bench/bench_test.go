package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// drainTimeout bounds one drain; even the slowest variant moves 20k messages in seconds.
const drainTimeout = 5 * time.Minute

// prefillChunk is the producer transaction size used to build a backlog; the backlog is written
// before the clock starts, so it only has to be the same for every variant.
const prefillChunk = 500

// BenchmarkOutboxPublish measures the producer side: messages written into the outbox by one client,
// in committed transactions of 1, 10 or 100 messages; b.N counts each writer's messages. The
// baseline, plain-insert, is what writing the same topic, key, UUID and payload costs without any
// outbox: one plain INSERT into an ordinary event table, a multi-row one for several messages.
// watermill-forwarder is Watermill's outbox publisher (a forwarder publisher over watermill-sql's
// publisher on the same transaction).
//
// The writers take turns, a few transactions each, and each one's rate counts only its own turns:
// on a shared machine, load that comes and goes then weighs on all of them alike, where writers
// run one after the other would each meet different load.
func BenchmarkOutboxPublish(b *testing.B) {
	for _, perTx := range []int{1, 10, 100} {
		name := fmt.Sprintf("%d-msgs-per-tx", perTx)
		if perTx == 1 {
			name = "1-msg-per-tx"
		}
		b.Run(name, func(b *testing.B) {
			plain, wm, tb := txtest.New(b), newWatermillOutbox(b, txtest.New(b)), newTxboxOutbox(b, txtest.New(b))
			interleave(b, perTx, []writer{
				{"plain-insert", plain, plainInsert(b, plain, "orders")},
				{"watermill-forwarder", wm.env, wm.publish("orders")},
				{"txbox", tb.env, tb.publish("orders")},
			})
		})
	}
}

type writer struct {
	name  string
	env   *txtest.Env
	write func(pgx.Tx, []*message.Message) error
}

// turnMessages is how many messages a writer writes per turn: enough transactions that switching
// writers costs nothing measurable, few enough that every writer meets the same load.
const turnMessages = 200

// interleave has each writer write b.N messages in transactions of perTx, taking turns, and
// reports each one's rate as <name>-msgs/s.
func interleave(b *testing.B, perTx int, writers []writer) {
	msgs := make([][]*message.Message, len(writers))
	for i := range writers {
		msgs[i] = messages(b.N, true)
	}
	spent := make([]time.Duration, len(writers))
	turn := max(turnMessages/perTx, 1) * perTx
	b.ResetTimer()
	for start, round := 0, 0; start < b.N; start, round = start+turn, round+1 {
		for k := range writers {
			// Who goes first rotates, so no writer always follows the same one.
			i := (k + round) % len(writers)
			began := time.Now()
			writeInChunks(b, writers[i].env, msgs[i][start:min(start+turn, b.N)], perTx, writers[i].write)
			spent[i] += time.Since(began)
		}
	}
	b.StopTimer()
	for i, w := range writers {
		b.ReportMetric(float64(b.N)/spent[i].Seconds(), w.name+"-msgs/s")
	}
}

// BenchmarkRelayDrain measures the time to move a backlog of b.N committed messages to Kafka,
// counting from the start of the process that moves them.
//
//   - watermill-forwarder: Watermill's outbox, the baseline (watermill-sql subscriber → forwarder →
//     watermill-kafka Publisher).
//   - watermill-publisher-sink: the txbox relay publishing through watermill-kafka's Publisher
//     (relay.WatermillSink), which sends one message per request.
//   - txbox-idempotent: the relay's Kafka sink with an idempotent, non-transactional producer.
//   - txbox-transactional: the relay's default, one Kafka transaction per batch, fenced per shard.
func BenchmarkRelayDrain(b *testing.B) {
	b.Run("watermill-forwarder", func(b *testing.B) {
		o := newWatermillOutbox(b, newEnv(b))
		topic := kafkatest.Topic(b)
		writeInChunks(b, o.env, messages(b.N, true), prefillChunk, o.publish(topic))
		b.ResetTimer()
		forwarded, stop := o.startForwarder(b, 10*time.Millisecond)
		waitUntil(b, "the forwarder to drain the backlog", drainTimeout, func() bool { return forwarded() >= b.N })
		b.StopTimer()
		stop()
		requireRecords(b, topic, b.N)
		reportRate(b, b.N)
	})
	b.Run("watermill-publisher-sink", func(b *testing.B) {
		pub := watermillKafkaPublisher(b)
		defer pub.Close()
		drainWithRelay(b, func(*txtest.Env) relay.Sink { return relay.WatermillSink{Publisher: pub, KeyRouting: relay.Unordered} })
	})
	b.Run("txbox-idempotent", func(b *testing.B) {
		drainWithRelay(b, func(env *txtest.Env) relay.Sink { return kafkaSink(b, env, false) })
	})
	b.Run("txbox-transactional", func(b *testing.B) {
		drainWithRelay(b, func(env *txtest.Env) relay.Sink { return kafkaSink(b, env, true) })
	})
}

// warmShare is the part of a backlog a pipeline moves before BenchmarkRelayDrainWarm starts its
// clock: by then every shard's lease is held and its producer open.
const warmShare = 10

// BenchmarkRelayDrainWarm measures the steady rate at which a running pipeline moves a backlog of
// b.N committed messages to Kafka: the clock starts once the first tenth has arrived, so start-up
// is not counted (BenchmarkRelayDrain counts it).
//
//   - raw-idempotent-producer: the baseline, no database at all: one sarama AsyncProducer with
//     Idempotent=true and acks=all sending the records the relay would send for the same messages
//     (watermill-kafka's marshaler, keyed), as fast as it takes them.
//   - watermill-forwarder: Watermill's outbox.
//   - txbox: the relay with its defaults (transactional Kafka sink, 16 shards, batches of 500).
//   - txbox-no-broker: the same relay with a sink that sends nothing: its database work alone
//     (reads and fenced completions), the most any broker could leave it.
func BenchmarkRelayDrainWarm(b *testing.B) {
	b.Run("raw-idempotent-producer", func(b *testing.B) {
		topic := kafkatest.Topic(b)
		records := make([]*sarama.ProducerMessage, b.N)
		for i, m := range messages(b.N, true) {
			rec, err := kafka.DefaultMarshaler{}.Marshal(topic, m)
			if err != nil {
				b.Fatal(err)
			}
			rec.Key = sarama.StringEncoder(m.Metadata.Get(outbox.PartitionKeyMetadata))
			records[i] = rec
		}
		p := idempotentProducer(b)
		defer p.Close()
		warm := b.N / warmShare
		produce(b, p, records[:warm])
		b.ResetTimer()
		produce(b, p, records[warm:])
		b.StopTimer()
		requireRecords(b, topic, b.N)
		reportRate(b, b.N-warm)
	})
	b.Run("watermill-forwarder", func(b *testing.B) {
		o := newWatermillOutbox(b, newEnv(b))
		topic := kafkatest.Topic(b)
		writeInChunks(b, o.env, messages(b.N, true), prefillChunk, o.publish(topic))
		forwarded, stop := o.startForwarder(b, 10*time.Millisecond)
		drainWarm(b, "the forwarder", forwarded)
		stop()
		requireRecords(b, topic, b.N)
	})
	b.Run("txbox", func(b *testing.B) {
		o := newTxboxOutbox(b, newEnv(b))
		topic := kafkatest.Topic(b)
		writeInChunks(b, o.env, messages(b.N, true), prefillChunk, o.publish(topic))
		published, stop := startRelay(b, o.env, kafkaSink(b, o.env, true))
		drainWarm(b, "the relay", published)
		stop()
		requireRecords(b, topic, b.N)
	})
	b.Run("txbox-no-broker", func(b *testing.B) {
		o := newTxboxOutbox(b, newEnv(b))
		writeInChunks(b, o.env, messages(b.N, true), prefillChunk, o.publish(kafkatest.Topic(b)))
		published, stop := startRelay(b, o.env, discardSink{})
		drainWarm(b, "the relay", published)
		stop()
		requireDrained(b, o.env)
	})
}

// drainWarm times a running pipeline from when moved first reaches a tenth of the backlog until
// it reaches all of it, and reports the rate over that stretch.
func drainWarm(b *testing.B, who string, moved func() int) {
	waitUntil(b, who+" to warm up", drainTimeout, func() bool { return moved() >= b.N/warmShare })
	from := moved()
	b.ResetTimer()
	waitUntil(b, who+" to drain the backlog", drainTimeout, func() bool { return moved() >= b.N })
	b.StopTimer()
	reportRate(b, b.N-from)
}

func drainWithRelay(b *testing.B, sink func(*txtest.Env) relay.Sink) {
	o := newTxboxOutbox(b, newEnv(b))
	topic := kafkatest.Topic(b)
	writeInChunks(b, o.env, messages(b.N, true), prefillChunk, o.publish(topic))
	b.ResetTimer()
	published, stop := startRelay(b, o.env, sink(o.env))
	waitUntil(b, "the relay to drain the backlog", drainTimeout, func() bool { return published() >= b.N })
	b.StopTimer()
	stop()
	requireRecords(b, topic, b.N)
	reportRate(b, b.N)
}

// BenchmarkInboxDedup measures one handler goroutine behind the inbox middleware; the handler
// inserts one business row. The baseline is the same handler in a plain transaction, without
// deduplication. inbox-fresh-no-attempt-count turns off the durable attempt counter (MaxAttempts
// < 0), whose own small transaction per delivery is what bounds poison messages. The sql-floor
// variants are bounds, not txbox: the least SQL any inbox adds to the handler's transaction, written
// by hand (benchFloor).
func BenchmarkInboxDedup(b *testing.B) {
	b.Run("plain-tx", func(b *testing.B) {
		env := newEffectsEnv(b)
		msgs := messages(b.N, false)
		ctx := context.Background()
		b.ResetTimer()
		for _, m := range msgs {
			err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error { return applyEffect(ctx, env, tx, m) })
			if err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		reportRate(b, b.N)
	})
	b.Run("inbox-fresh", func(b *testing.B) { benchInbox(b, inbox.DefaultMaxAttempts, false) })
	b.Run("inbox-fresh-no-attempt-count", func(b *testing.B) { benchInbox(b, -1, false) })
	b.Run("inbox-duplicate", func(b *testing.B) { benchInbox(b, inbox.DefaultMaxAttempts, true) })
	b.Run("sql-floor-row", func(b *testing.B) { benchFloor(b, false) })
	b.Run("sql-floor-row-and-marker", func(b *testing.B) { benchFloor(b, true) })
}

// benchFloor runs BenchmarkInboxDedup's handler in the transaction any inbox must make, in plain
// SQL: the business row plus a row keyed by the message that settles it, inserted in the round trip
// that begins the transaction. With marker, a crash marker goes first in that round trip, in a
// transaction of its own committed without waiting for its WAL, and the handler's transaction
// deletes it: the least that counts an attempt which crashes its process. Against plain-tx, it
// bounds what the inbox can reach on the machine.
func benchFloor(b *testing.B, marker bool) {
	env := newEffectsEnv(b)
	ctx := context.Background()
	for _, table := range []string{"floor_inbox", "floor_attempt"} {
		if _, err := env.Pool.Exec(ctx, "CREATE TABLE "+env.Q(table)+" (consumer text, dedup_key text, PRIMARY KEY (consumer, dedup_key))"); err != nil {
			b.Fatal(err)
		}
	}
	msgs := messages(b.N, false)
	b.ResetTimer()
	for _, m := range msgs {
		batch := &pgx.Batch{}
		batch.BeginTx(pgx.TxOptions{})
		if marker {
			batch.Queue("SET LOCAL synchronous_commit = off")
			batch.Queue("INSERT INTO "+env.Q("floor_attempt")+" VALUES ('bench', $1)", m.UUID)
			batch.Queue("commit")
			batch.Queue("begin")
			batch.Queue("DELETE FROM "+env.Q("floor_attempt")+" WHERE consumer = 'bench' AND dedup_key = $1", m.UUID)
		}
		batch.Queue("INSERT INTO "+env.Q("floor_inbox")+" VALUES ('bench', $1)", m.UUID)
		results := env.Pool.SendBatch(ctx, batch)
		tx := results.Tx()
		if err := results.Close(); err != nil {
			b.Fatal(err)
		}
		if err := applyEffect(ctx, env, tx, m); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	reportRate(b, b.N)
}

// BenchmarkInboxRouter measures fresh messages through a Watermill router, one handler, the way an
// application consumes a Kafka partition: b.N messages published on an in-memory pub/sub, delivered
// one at a time, each handled and acknowledged before the next is delivered. bare-handler, the
// baseline, applies the business row in its own transaction; inbox-fresh is the same handler
// behind the inbox middleware with its defaults.
func BenchmarkInboxRouter(b *testing.B) {
	b.Run("bare-handler", func(b *testing.B) {
		env := newEffectsEnv(b)
		benchRouter(b, func(m *message.Message) error {
			return pgx.BeginFunc(m.Context(), env.Pool, func(tx pgx.Tx) error { return applyEffect(m.Context(), env, tx, m) })
		}, nil)
	})
	// inbox-fresh-no-attempt-count shows what poison-pill protection (the crash marker) costs.
	for _, v := range []struct {
		name        string
		maxAttempts int
	}{{"inbox-fresh", inbox.DefaultMaxAttempts}, {"inbox-fresh-no-attempt-count", -1}} {
		b.Run(v.name, func(b *testing.B) {
			env := newEffectsEnv(b)
			ib, err := inbox.New(inbox.Config{DB: env.Pool, Consumer: "bench", Schema: env.Schema, MaxAttempts: v.maxAttempts}, nil)
			if err != nil {
				b.Fatal(err)
			}
			benchRouter(b, func(m *message.Message) error {
				tx, _ := inbox.TxFromContext(m.Context())
				return applyEffect(m.Context(), env, tx, m)
			}, ib.Middleware)
		})
	}
}

// benchRouter runs handle (behind middleware, if any) in a router and times b.N messages from the
// first publish until the last is handled.
func benchRouter(b *testing.B, handle func(*message.Message) error, middleware message.HandlerMiddleware) {
	logger := watermill.NopLogger{}
	// Without BlockPublishUntilSubscriberAck, gochannel hands the subscriber the next message before
	// the last is acknowledged, and the router runs each in a goroutine of its own: every message
	// would be in flight at once, as many as the pool has connections.
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		b.Fatal(err)
	}
	var handled atomic.Int64
	h := router.AddConsumerHandler("bench", "orders", pubsub, func(m *message.Message) error {
		if err := handle(m); err != nil {
			return err
		}
		handled.Add(1)
		return nil
	})
	if middleware != nil {
		h.AddMiddleware(middleware)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	msgs := messages(b.N, false)
	b.ResetTimer()
	if err := pubsub.Publish("orders", msgs...); err != nil {
		b.Fatal(err)
	}
	waitUntil(b, "the router to handle every message", drainTimeout, func() bool { return handled.Load() >= int64(b.N) })
	b.StopTimer()
	cancel()
	if err := <-done; err != nil {
		b.Error(err)
	}
	reportRate(b, b.N)
}

func newEffectsEnv(b *testing.B) *txtest.Env {
	env := txtest.New(b)
	if _, err := env.Pool.Exec(context.Background(), "CREATE TABLE "+env.Q("bench_effect")+" (uuid text PRIMARY KEY, payload bytea NOT NULL)"); err != nil {
		b.Fatal(err)
	}
	return env
}

func applyEffect(ctx context.Context, env *txtest.Env, tx pgx.Tx, m *message.Message) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+env.Q("bench_effect")+" (uuid, payload) VALUES ($1, $2)", m.UUID, m.Payload)
	return err
}

// benchInbox calls the middleware directly, without a broker, so only the inbox's cost is measured.
// With duplicates, every message is marked processed before the clock starts.
func benchInbox(b *testing.B, maxAttempts int, duplicates bool) {
	env := newEffectsEnv(b)
	ib, err := inbox.New(inbox.Config{DB: env.Pool, Consumer: "bench", Schema: env.Schema, MaxAttempts: maxAttempts}, nil)
	if err != nil {
		b.Fatal(err)
	}
	handle := ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.TxFromContext(m.Context())
		return nil, applyEffect(m.Context(), env, tx, m)
	})
	msgs := messages(b.N, false)
	if duplicates {
		markProcessed(b, env, "bench", msgs)
	}
	b.ResetTimer()
	for _, m := range msgs {
		if _, err := handle(m); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	reportRate(b, b.N)
}

// latencyGap spaces messages at 500 per second: moderate load, so the latency is the pipeline's
// own, not queueing.
const latencyGap = 2 * time.Millisecond

// forwarderPoll is the forwarder's poll interval in BenchmarkLatency: Watermill's outbox tuned for
// latency. The relay keeps its default.
const forwarderPoll = 10 * time.Millisecond

// idleWindow is how long BenchmarkLatency watches a pipeline with nothing to do.
const idleWindow = 3 * time.Second

// BenchmarkLatency measures commit → consumer receive of single-message transactions at 500
// messages per second, through each pipeline to a read_committed watermill-kafka subscriber; b.N
// counts messages. Afterwards, with the consumer stopped and nothing to publish, it reports the CPU
// time per second of that idle interval: this process's (idle-cpu-ms/s: the pipeline's polling plus
// the in-process Kafka's own idle cost, which both variants pay alike) and that of the PostgreSQL
// backends answering the pipeline's polls (idle-db-cpu-ms/s).
//
// txbox-stages is txbox again with a span recorder as the relay's TracerProvider, to tell where the
// time goes (p50 of each stage): from commit to the relay holding the row it read (p50-read-ms:
// waiting for the relay's next look, the look, the read), the Kafka transaction that publishes it
// (p50-kafka-ms: the relay's producer span), and from the transaction's commit to the consumer
// (p50-deliver-ms). Recording spans costs the relay a few microseconds a message, so its total is
// not txbox's figure.
func BenchmarkLatency(b *testing.B) {
	b.Run("watermill-forwarder", func(b *testing.B) {
		o := newWatermillOutbox(b, newEnv(b))
		_, stop := o.startForwarder(b, forwarderPoll)
		defer stop()
		topic := kafkatest.Topic(b)
		measureLatency(b, o.env, o.publish(topic), topic)
	})
	b.Run("txbox", func(b *testing.B) {
		o := newTxboxOutbox(b, newEnv(b))
		_, stop := startRelay(b, o.env, kafkaSink(b, o.env, true))
		defer stop()
		topic := kafkatest.Topic(b)
		measureLatency(b, o.env, o.publish(topic), topic)
	})
	b.Run("txbox-stages", func(b *testing.B) {
		o := newTxboxOutbox(b, newEnv(b))
		spans := tracetest.NewSpanRecorder()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
		_, stop := startRelay(b, o.env, kafkaSink(b, o.env, true), func(c *relay.Config) { c.TracerProvider = tp })
		defer stop()
		topic := kafkatest.Topic(b)
		measureLatency(b, o.env, o.publish(topic), topic, spans)
	})
}

// measureLatency measures write's commit → consumer latency; with spans (the relay's producer spans),
// each stage's instead of the idle CPU (see BenchmarkLatency).
func measureLatency(b *testing.B, env *txtest.Env, write func(pgx.Tx, []*message.Message) error, topic string, spans ...*tracetest.SpanRecorder) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := kafkatest.NewSubscriber(b, "latency-"+env.Schema).Subscribe(ctx, topic)
	if err != nil {
		b.Fatal(err)
	}
	var mu sync.Mutex
	received := map[string]time.Time{}
	go func() {
		for m := range ch {
			at := time.Now()
			mu.Lock()
			received[m.UUID] = at
			mu.Unlock()
			m.Ack()
		}
	}()
	arrived := func(msgs []*message.Message) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, m := range msgs {
			if _, ok := received[m.UUID]; !ok {
				return false
			}
		}
		return true
	}

	// Time nothing until the consumer group has joined and every shard's producer is open; a few
	// keys reach every partition.
	warm := messages(50, true)
	writeInChunks(b, env, warm, 1, write)
	waitUntil(b, "the pipeline to deliver its first messages", time.Minute, func() bool { return arrived(warm) })

	msgs := messages(b.N, true)
	sent := make([]time.Time, b.N)
	tick := time.NewTicker(latencyGap)
	defer tick.Stop()
	b.ResetTimer()
	for i := range msgs {
		<-tick.C
		writeInChunks(b, env, msgs[i:i+1], 1, write)
		sent[i] = time.Now()
	}
	waitUntil(b, "every message to arrive", time.Minute, func() bool { return arrived(msgs) })
	b.StopTimer()

	mu.Lock()
	lat := make([]time.Duration, len(msgs))
	for i, m := range msgs {
		// The consumer can see a message a hair before Commit returns to the producer.
		lat[i] = max(received[m.UUID].Sub(sent[i]), 0)
	}
	mu.Unlock()
	reportLatency(b, lat)
	if len(spans) > 0 {
		reportStages(b, spans[0], msgs, sent, received)
		return
	}

	cancel() // the consumer's fetches are not the pipeline's
	time.Sleep(time.Second)
	reportIdleCPU(b, env, idleWindow)
}

// markProcessed writes the inbox rows that processing msgs would have left, in one statement:
// processing them through the middleware first would take longer than the benchmark itself.
func markProcessed(b *testing.B, env *txtest.Env, consumer string, msgs []*message.Message) {
	uuids := make([]string, len(msgs))
	for i, m := range msgs {
		uuids[i] = m.UUID
	}
	_, err := env.Pool.Exec(context.Background(), "INSERT INTO "+env.Q("txbox_inbox")+
		" (consumer, dedup_key, message_uuid, topic) SELECT $1, u, u, '' FROM unnest($2::text[]) AS u", consumer, uuids)
	if err != nil {
		b.Fatal(err)
	}
}
