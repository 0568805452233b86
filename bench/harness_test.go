package bench

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// payloadBytes matches the message size FACTS.md's throughput numbers were measured with.
const payloadBytes = 200

// payload is a JSON document of payloadBytes, because watermill-sql's default payload column is JSON.
func payload(i int) []byte {
	head := fmt.Sprintf(`{"n":%d,"pad":"`, i)
	return []byte(head + strings.Repeat("x", payloadBytes-len(head)-2) + `"}`)
}

// messages returns n messages. Keyed ones carry one of 1000 partition keys, like events of many
// orders, so they spread over every relay shard.
func messages(n int, keyed bool) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), payload(i))
		if keyed {
			outbox.SetPartitionKey(msgs[i], fmt.Sprintf("order-%d", i%1000))
		}
	}
	return msgs
}

// writeInChunks writes msgs with write, per transactions of chunk messages.
func writeInChunks(b *testing.B, env *txtest.Env, msgs []*message.Message, chunk int, write func(pgx.Tx, []*message.Message) error) {
	b.Helper()
	ctx := context.Background()
	for start := 0; start < len(msgs); start += chunk {
		err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error {
			return write(tx, msgs[start:min(start+chunk, len(msgs))])
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}

func reportRate(b *testing.B, n int) {
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "msgs/s")
}

// waitUntil polls cond; a pipeline that stalls fails the benchmark instead of hanging it.
func waitUntil(b testing.TB, what string, timeout time.Duration, cond func() bool) {
	b.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			b.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func quietLogger(b testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(logWriter{b}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// logWriter sends logs to b.Log, which prints them after the result line rather than inside it.
type logWriter struct{ b testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.b.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// newEnv is a migrated schema whose pool is the one `txbox relay` opens with its defaults: pgx's
// default size, max(4, CPUs), fewer connections than the relay has shards (a shard holds one only
// for its round trips). More measured slower here, not faster: each connection plans the shard
// read once, and more backends than cores only contend (README, "Connections"). The pool already
// holds all its connections: opening one (a process fork) takes longer than publishing a batch, so
// a cold pool would time connection set-up rather than the pipeline.
func newEnv(b *testing.B) *txtest.Env {
	env := txtest.New(b)
	ctx := context.Background()
	defaults, err := pgxpool.ParseConfig(env.URL)
	if err != nil {
		b.Fatal(err)
	}
	cfg := env.Pool.Config()
	cfg.MaxConns = defaults.MaxConns
	if env.Pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(env.Pool.Close)
	conns := make([]*pgxpool.Conn, cfg.MaxConns)
	for i := range conns {
		c, err := env.Pool.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		conns[i] = c
	}
	for _, c := range conns {
		c.Release()
	}
	return env
}

// plainInsert is the outbox write's baseline: the same topic, partition key, UUID and payload in a
// table shaped like an ordinary event table (identity key, creation time), one statement per
// transaction: a single-row INSERT, or a multi-row VALUES list for several messages.
func plainInsert(b *testing.B, env *txtest.Env, topic string) func(pgx.Tx, []*message.Message) error {
	table := env.Q("bench_plain")
	_, err := env.Pool.Exec(context.Background(), "CREATE TABLE "+table+` (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		topic text NOT NULL, partition_key text NOT NULL, uuid text NOT NULL, payload bytea NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`)
	if err != nil {
		b.Fatal(err)
	}
	statements := map[int]string{}
	return func(tx pgx.Tx, msgs []*message.Message) error {
		sql, ok := statements[len(msgs)]
		if !ok {
			var sb strings.Builder
			sb.WriteString("INSERT INTO " + table + " (topic, partition_key, uuid, payload) VALUES ")
			for i := range msgs {
				if i > 0 {
					sb.WriteString(", ")
				}
				fmt.Fprintf(&sb, "($%d, $%d, $%d, $%d)", 4*i+1, 4*i+2, 4*i+3, 4*i+4)
			}
			sql = sb.String()
			statements[len(msgs)] = sql
		}
		args := make([]any, 0, 4*len(msgs))
		for _, m := range msgs {
			args = append(args, topic, m.Metadata.Get(outbox.PartitionKeyMetadata), m.UUID, []byte(m.Payload))
		}
		_, err := tx.Exec(context.Background(), sql, args...)
		return err
	}
}

// --- txbox --------------------------------------------------------------------------------------

type txboxOutbox struct {
	env    *txtest.Env
	writer *outbox.Writer
}

func newTxboxOutbox(b *testing.B, env *txtest.Env) *txboxOutbox {
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	if err != nil {
		b.Fatal(err)
	}
	return &txboxOutbox{env: env, writer: w}
}

func (o *txboxOutbox) publish(topic string) func(pgx.Tx, []*message.Message) error {
	return func(tx pgx.Tx, msgs []*message.Message) error {
		return o.writer.Publish(context.Background(), tx, topic, msgs...)
	}
}

func kafkaSink(b testing.TB, env *txtest.Env, transactional bool) relay.Sink {
	s, err := relay.NewKafkaSink(relay.KafkaConfig{
		Brokers:               kafkatest.Brokers(b),
		Transactional:         &transactional,
		TransactionalIDPrefix: env.Schema,
	})
	if err != nil {
		b.Fatal(err)
	}
	return s
}

// startRelay runs a relay with its defaults (16 shards, batches of 500, looks for new rows every
// 1ms while they come). published counts the messages it has published and completed.
func startRelay(b testing.TB, env *txtest.Env, sink relay.Sink, configure ...func(*relay.Config)) (published func() int, stop func()) {
	b.Helper()
	reg := prometheus.NewRegistry()
	cfg := relay.Config{
		DB: env.Pool, Sink: sink, Schema: env.Schema,
		Logger: quietLogger(b), Registerer: reg,
	}
	for _, c := range configure {
		c(&cfg)
	}
	r, err := relay.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	published = func() int {
		mfs, err := reg.Gather()
		if err != nil {
			b.Error(err)
			return 0
		}
		for _, mf := range mfs {
			if mf.GetName() == "txbox_relay_published_total" {
				return int(mf.GetMetric()[0].GetCounter().GetValue())
			}
		}
		return 0
	}
	return published, func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	}
}

// discardSink publishes nothing and succeeds: a relay with it does only its database work.
type discardSink struct{}

func (discardSink) Open(context.Context, int, int64) (relay.ShardPublisher, error) {
	return discardSink{}, nil
}
func (discardSink) Publish(context.Context, []relay.Message) error { return nil }
func (discardSink) Close() error                                   { return nil }

// requireDrained fails b unless env's outbox is empty: every row was completed.
func requireDrained(b *testing.B, env *txtest.Env) {
	b.Helper()
	var left int
	if err := env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+env.Q("txbox_outbox")).Scan(&left); err != nil {
		b.Fatal(err)
	}
	if left > 0 {
		b.Fatalf("%d rows are left in the outbox", left)
	}
}

// --- Watermill's outbox: watermill-sql + components/forwarder -----------------------------------

// watermillOutbox is Watermill's documented outbox: producers publish through a forwarder publisher
// wrapping a watermill-sql publisher on their transaction; the forwarder reads the table with a
// watermill-sql subscriber and publishes to Kafka. Tables live in the test's schema.
type watermillOutbox struct {
	env     *txtest.Env
	schema  wsql.DefaultPostgreSQLSchema
	offsets wsql.DefaultPostgreSQLOffsetsAdapter
}

// forwarderTopic is the watermill-sql topic the forwarder reads its envelopes from.
const forwarderTopic = "forwarder"

func newWatermillOutbox(b *testing.B, env *txtest.Env) *watermillOutbox {
	o := &watermillOutbox{
		env: env,
		schema: wsql.DefaultPostgreSQLSchema{
			GenerateMessagesTableName: func(topic string) string {
				return pgx.Identifier{env.Schema, "watermill_" + topic}.Sanitize()
			},
		},
		offsets: wsql.DefaultPostgreSQLOffsetsAdapter{
			GenerateMessagesOffsetsTableName: func(topic string) string {
				return pgx.Identifier{env.Schema, "watermill_offsets_" + topic}.Sanitize()
			},
		},
	}
	if err := o.subscriber(b, time.Second).SubscribeInitialize(forwarderTopic); err != nil {
		b.Fatal(err)
	}
	return o
}

func (o *watermillOutbox) publish(topic string) func(pgx.Tx, []*message.Message) error {
	return func(tx pgx.Tx, msgs []*message.Message) error {
		pub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: o.schema}, nil)
		if err != nil {
			return err
		}
		return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: forwarderTopic}).Publish(topic, msgs...)
	}
}

func (o *watermillOutbox) subscriber(b *testing.B, poll time.Duration) *wsql.Subscriber {
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(o.env.Pool), wsql.SubscriberConfig{
		ConsumerGroup:  "forwarder",
		PollInterval:   poll,
		SchemaAdapter:  o.schema,
		OffsetsAdapter: o.offsets,
	}, nil)
	if err != nil {
		b.Fatal(err)
	}
	return sub
}

// startForwarder runs Watermill's forwarder to Kafka. forwarded counts the messages it has
// published.
func (o *watermillOutbox) startForwarder(b *testing.B, poll time.Duration) (forwarded func() int, stop func()) {
	b.Helper()
	pub := watermillKafkaPublisher(b)
	var n atomic.Int64
	count := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				n.Add(1)
			}
			return out, err
		}
	}
	f, err := forwarder.NewForwarder(o.subscriber(b, poll), pub, nil, forwarder.Config{
		ForwarderTopic: forwarderTopic,
		Middlewares:    []message.HandlerMiddleware{count},
		CloseTimeout:   10 * time.Second,
	})
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	return func() int { return int(n.Load()) }, func() {
		if err := f.Close(); err != nil {
			b.Error(err)
		}
		if err := <-done; err != nil {
			b.Error(err)
		}
		_ = pub.Close()
	}
}

// watermillKafkaPublisher is watermill-kafka's Publisher with its defaults, except a protocol
// version kfake speaks, a short metadata backoff (so a new topic is found at once), and acks=all
// like txbox's producer, so both wait for the same durability.
func watermillKafkaPublisher(b *testing.B) *kafka.Publisher {
	c := kafka.DefaultSaramaSyncPublisherConfig()
	c.Version = sarama.V2_8_0_0
	c.Metadata.Retry.Backoff = 100 * time.Millisecond
	c.Producer.RequiredAcks = sarama.WaitForAll
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:               kafkatest.Brokers(b),
		Marshaler:             kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: c,
	}, nil)
	if err != nil {
		b.Fatal(err)
	}
	return pub
}

// --- Kafka --------------------------------------------------------------------------------------

// requireRecords fails unless topic holds at least n records: a drain that "finished" without
// reaching Kafka would otherwise look fast. Transaction markers count too, hence at least.
func requireRecords(b *testing.B, topic string, n int) {
	b.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V2_8_0_0
	client, err := sarama.NewClient(kafkatest.Brokers(b), c)
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	partitions, err := client.Partitions(topic)
	if err != nil {
		b.Fatal(err)
	}
	var total int64
	for _, p := range partitions {
		off, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			b.Fatal(err)
		}
		total += off
	}
	if total < int64(n) {
		b.Fatalf("topic %s holds %d records, want at least %d", topic, total, n)
	}
}

// idempotentProducer is the relay drain's baseline producer: sarama with the settings the relay's
// sink forces (idempotent, acks=all, one request in flight per broker), without transactions.
func idempotentProducer(b *testing.B) sarama.AsyncProducer {
	c := sarama.NewConfig()
	c.Version = sarama.V2_8_0_0
	c.Metadata.Retry.Backoff = 100 * time.Millisecond
	c.Producer.Idempotent = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Return.Successes = true
	c.Producer.Retry.Max = 5
	c.Net.MaxOpenRequests = 1
	p, err := sarama.NewAsyncProducer(kafkatest.Brokers(b), c)
	if err != nil {
		b.Fatal(err)
	}
	return p
}

// produce sends records and returns once Kafka acknowledged all of them.
func produce(b *testing.B, p sarama.AsyncProducer, records []*sarama.ProducerMessage) {
	b.Helper()
	go func() {
		for _, r := range records {
			p.Input() <- r
		}
	}()
	for range records {
		select {
		case <-p.Successes():
		case err := <-p.Errors():
			b.Fatal(err)
		case <-time.After(drainTimeout):
			b.Fatalf("timed out after %s waiting for Kafka to acknowledge", drainTimeout)
		}
	}
}

// reportIdleCPU reports the CPU time spent during window, in milliseconds per second: by this
// process (idle-cpu-ms/s) and by the PostgreSQL backends of env's pool (idle-db-cpu-ms/s), which
// is where a poll's query runs. The second is left out where PostgreSQL's processes cannot be
// read (a server on another machine).
func reportIdleCPU(b *testing.B, env *txtest.Env, window time.Duration) {
	self := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			b.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	backends := poolBackends(env)
	selfBefore, dbBefore, dbOK := self(), backendCPU(backends), len(backends) > 0
	began := time.Now()
	time.Sleep(window)
	took := time.Since(began).Seconds()
	perSecond := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) / took }
	b.ReportMetric(perSecond(self()-selfBefore), "idle-cpu-ms/s")
	if dbAfter := backendCPU(backends); dbOK && dbAfter >= 0 && dbBefore >= 0 {
		b.ReportMetric(perSecond(dbAfter-dbBefore), "idle-db-cpu-ms/s")
	}
}

// poolBackends are the process ids of the PostgreSQL backends behind env's pool, which the
// pipeline uses alone. newEnv opened them all and the pool keeps them, so taking whichever are
// idle, a few times over, finds each one.
func poolBackends(env *txtest.Env) []int {
	ctx := context.Background()
	seen := map[int]bool{}
	for deadline := time.Now().Add(time.Second); len(seen) < int(env.Pool.Stat().TotalConns()) && time.Now().Before(deadline); {
		for _, c := range env.Pool.AcquireAllIdle(ctx) {
			seen[int(c.Conn().PgConn().PID())] = true
			c.Release()
		}
		time.Sleep(5 * time.Millisecond)
	}
	return slices.Collect(maps.Keys(seen))
}

// clockTicks is Linux's USER_HZ, the unit of /proc/<pid>/stat's CPU times, on every architecture
// Go supports.
const clockTicks = 100

// backendCPU is the CPU time the processes pids have used, from /proc; -1 if one cannot be read.
func backendCPU(pids []int) time.Duration {
	var total time.Duration
	for _, pid := range pids {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return -1
		}
		// The command name, in parentheses, may hold spaces; utime and stime are the 12th and
		// 13th fields after it.
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) < 13 {
			return -1
		}
		for _, f := range fields[11:13] {
			ticks, err := strconv.ParseInt(f, 10, 64)
			if err != nil {
				return -1
			}
			total += time.Duration(ticks) * time.Second / clockTicks
		}
	}
	return total
}

// percentile of sorted durations, nearest rank.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(i, 0)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func reportLatency(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	b.ReportMetric(ms(percentile(lat, 0.50)), "p50-ms")
	b.ReportMetric(ms(percentile(lat, 0.99)), "p99-ms")
}

// reportStages reports the median of each stage of msgs' way (see BenchmarkLatency), from the
// relay's producer span of each message: it starts once the relay holds the row it read and ends
// once the Kafka transaction that published it committed.
func reportStages(b *testing.B, spans *tracetest.SpanRecorder, msgs []*message.Message, sent []time.Time, received map[string]time.Time) {
	byUUID := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range spans.Ended() {
		for _, a := range s.Attributes() {
			if a.Key == "messaging.message.id" {
				byUUID[a.Value.AsString()] = s
			}
		}
	}
	var read, kafka, deliver []time.Duration
	for i, m := range msgs {
		s, ok := byUUID[m.UUID]
		if !ok {
			b.Fatalf("no producer span for message %s", m.UUID)
		}
		read = append(read, s.StartTime().Sub(sent[i]))
		kafka = append(kafka, s.EndTime().Sub(s.StartTime()))
		deliver = append(deliver, received[m.UUID].Sub(s.EndTime()))
	}
	for _, stage := range []struct {
		unit string
		d    []time.Duration
	}{{"p50-read-ms", read}, {"p50-kafka-ms", kafka}, {"p50-deliver-ms", deliver}} {
		slices.Sort(stage.d)
		b.ReportMetric(ms(percentile(stage.d, 0.50)), stage.unit)
	}
}
