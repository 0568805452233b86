package inbox_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type bundle struct {
	env   *txtest.Env
	inbox *inbox.Inbox
	reg   *prometheus.Registry
	calls atomic.Int64 // handler invocations
}

func setup(t *testing.T, mutate func(*inbox.Config)) *bundle {
	t.Helper()
	return setupIn(t, txtest.New(t), mutate)
}

// setupIn is setup in env's database.
func setupIn(t *testing.T, env *txtest.Env, mutate func(*inbox.Config)) *bundle {
	t.Helper()
	_, err := env.Pool.Exec(context.Background(), "CREATE TABLE "+env.Q("effects")+" (id text, n int)")
	require.NoError(t, err)
	b := &bundle{env: env, reg: prometheus.NewRegistry()}
	cfg := inbox.Config{DB: env.Pool, Consumer: "billing", Schema: env.Schema, Registerer: b.reg, MaxAttempts: 3}
	if mutate != nil {
		mutate(&cfg)
	}
	b.inbox, err = inbox.New(cfg, nil)
	require.NoError(t, err)
	return b
}

// newRouter returns an in-memory pub/sub and a router to consume from it.
func newRouter(t *testing.T) (*gochannel.GoChannel, *message.Router) {
	t.Helper()
	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	return gochannel.NewGoChannel(gochannel.Config{}, logger), router
}

// handler applies the business effect: one row in effects per processing.
func (b *bundle) handler(fail func(*message.Message) error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		b.calls.Add(1)
		tx, ok := inbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no transaction in the handler's context")
		}
		if _, err := tx.Exec(msg.Context(), "INSERT INTO "+b.env.Q("effects")+" VALUES ($1, 1)", msg.UUID); err != nil {
			return nil, err
		}
		if fail != nil {
			return nil, fail(msg)
		}
		return nil, nil
	}
}

func (b *bundle) count(t *testing.T, table, where string, args ...any) int {
	t.Helper()
	var n int
	q := "SELECT count(*) FROM " + b.env.Q(table)
	if where != "" {
		q += " WHERE " + where
	}
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

func newMessage() *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(`{"amount":100}`))
}

// deliver hands the broker's copy of msg to the wrapped handler, as a router would: a fresh
// message value with the same UUID, payload and metadata.
func deliver(h message.HandlerFunc, msg *message.Message) error {
	cp := msg.Copy()
	_, err := h(cp)
	return err
}

func TestDuplicateDeliveriesChangeStateOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.inbox.Middleware(b.handler(nil))
	msg := newMessage()
	for range 5 {
		require.NoError(t, deliver(h, msg))
	}
	require.Equal(t, 1, b.count(t, "effects", "id = $1", msg.UUID))
	require.Equal(t, int64(1), b.calls.Load(), "the handler is not called for duplicates")
	require.Equal(t, 1, b.count(t, "txbox_inbox", "dedup_key = $1 AND state = 'done'", msg.UUID))
	require.Equal(t, 0, b.count(t, "txbox_inbox_attempt", ""), "attempt counters are cleared on success")
	require.Equal(t, 5.0, metric(t, b.reg, "txbox_dedup_checks_total"))
	require.Equal(t, 4.0, metric(t, b.reg, "txbox_dedup_hits_total"))
}

func TestConcurrentDeliveriesToTwoInstancesChangeStateOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// Two consumer instances: two middlewares over the same database and consumer name.
	other, err := inbox.New(inbox.Config{DB: b.env.Pool, Consumer: "billing", Schema: b.env.Schema, MaxAttempts: 3}, nil)
	require.NoError(t, err)
	// The handler holds its transaction open until both deliveries are in flight, so the second
	// delivery really races the first instead of arriving after its commit.
	entered := make(chan struct{}, 2)
	release := make(chan struct{})
	slow := func(*message.Message) error {
		entered <- struct{}{}
		<-release
		return nil
	}
	instances := []message.HandlerFunc{b.inbox.Middleware(b.handler(slow)), other.Middleware(b.handler(slow))}

	for range 20 {
		msg := newMessage()
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i, h := range instances {
			wg.Go(func() { errs[i] = deliver(h, msg) })
		}
		<-entered // the first delivery is inside the handler, holding the inbox row
		waitBlocked(t, b)
		close(release)
		wg.Wait()
		release = make(chan struct{})
		require.NoError(t, errors.Join(errs...))
		require.Equal(t, 1, b.count(t, "effects", "id = $1", msg.UUID))
	}
	require.Equal(t, int64(20), b.calls.Load(), "the handler ran once per message")
}

// waitBlocked waits until some session is waiting on a lock: the racing delivery is queued
// behind the first one's inbox row.
func waitBlocked(t *testing.T, b *bundle) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		err := b.env.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database() AND query LIKE '%txbox_inbox%'`).Scan(&n)
		return err == nil && n > 0
	}, 10*time.Second, 5*time.Millisecond)
}

func TestHandlerErrorRollsBackAndRedeliveryProcessesOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	w, err := outbox.New(outbox.Config{Schema: b.env.Schema})
	require.NoError(t, err)
	var failures atomic.Int64
	failures.Store(2)
	h := b.inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.TxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), "INSERT INTO "+b.env.Q("effects")+" VALUES ($1, 1)", msg.UUID); err != nil {
			return nil, err
		}
		if err := w.Publish(msg.Context(), tx, "downstream", newMessage()); err != nil {
			return nil, err
		}
		if failures.Add(-1) >= 0 {
			return nil, errors.New("downstream unavailable")
		}
		return nil, nil
	})
	msg := newMessage()
	for range 2 {
		require.ErrorContains(t, deliver(h, msg), "downstream unavailable")
		require.Equal(t, 0, b.count(t, "effects", ""), "business writes rolled back")
		require.Equal(t, 0, b.count(t, "txbox_inbox", ""), "no inbox row")
		require.Equal(t, 0, b.count(t, "txbox_outbox", ""), "no outbox rows")
	}
	require.NoError(t, deliver(h, msg))
	require.NoError(t, deliver(h, msg))
	require.Equal(t, 1, b.count(t, "effects", ""))
	require.Equal(t, 1, b.count(t, "txbox_outbox", ""))
}

func TestFailingMessageGoesToDLQAfterMaxAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil) // MaxAttempts: 3
	h := b.inbox.Middleware(b.handler(func(*message.Message) error { return errors.New("boom") }))
	msg := newMessage()
	for range 3 {
		require.Error(t, deliver(h, msg))
	}
	require.NoError(t, deliver(h, msg), "the 4th delivery is acknowledged: the message is dead")
	require.Equal(t, int64(3), b.calls.Load())
	require.Equal(t, 1, b.count(t, "txbox_dlq", "uuid = $1 AND reason = $2 AND attempts = 3 AND error LIKE '%boom%'", msg.UUID, inbox.ReasonAttemptsExhausted))
	require.Equal(t, 1, b.count(t, "txbox_inbox", "state = 'dead'"))
	require.NoError(t, deliver(h, msg), "a redelivery of a dead message is skipped")
	require.Equal(t, int64(3), b.calls.Load())
	require.Equal(t, 1, b.count(t, "txbox_dlq", ""))
	require.Equal(t, 0, b.count(t, "effects", ""))
}

func TestBadInputGoesToDLQAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *inbox.Config) { c.MaxPayloadBytes = 64 })
	h := b.inbox.Middleware(b.handler(func(m *message.Message) error {
		if string(m.Payload) == "poison" {
			return fmt.Errorf("%w: unknown currency", inbox.ErrUnprocessable)
		}
		return nil
	}))
	cases := map[string]*message.Message{
		inbox.ReasonNoID:          message.NewMessage("", []byte("{}")),
		inbox.ReasonTooLarge:      message.NewMessage(watermill.NewUUID(), make([]byte, 65)),
		inbox.ReasonUnprocessable: message.NewMessage(watermill.NewUUID(), []byte("poison")),
		inbox.ReasonBadMetadata:   message.NewMessage(watermill.NewUUID(), []byte("{}")),
	}
	cases[inbox.ReasonBadMetadata].Metadata.Set(outbox.ShardMetadata, "not-a-number")
	cases[inbox.ReasonBadMetadata].Metadata.Set(outbox.TokenMetadata, "7")
	for reason, msg := range cases {
		require.NoError(t, deliver(h, msg), reason)
		require.NoError(t, deliver(h, msg), reason+": redelivery")
		require.Equal(t, 1, b.count(t, "txbox_dlq", "reason = $1", reason), reason)
	}
	// Kafka headers are bytes: an id PostgreSQL cannot store as text, or metadata jsonb refuses,
	// must still end in the DLQ rather than fail on every delivery.
	badID := message.NewMessage("bad-\xff-\x00", []byte("{}"))
	badMeta := message.NewMessage(watermill.NewUUID(), make([]byte, 65))
	badMeta.Metadata.Set("note\x00", "\xfe")
	// Nor does its index take an id of 3,000 bytes that do not compress: every delivery failed,
	// for ever. The limit is MaxDedupKeyBytes.
	var random strings.Builder
	for random.Len() < 3000 {
		random.WriteString(rand.Text())
	}
	longID := message.NewMessage(random.String()[:3000], []byte("{}"))
	for _, msg := range []*message.Message{badID, badMeta, longID} {
		require.NoError(t, deliver(h, msg))
		require.NoError(t, deliver(h, msg), "redelivery")
	}
	require.Equal(t, 3, b.count(t, "txbox_dlq", "reason = $1", inbox.ReasonNoID))
	require.Equal(t, 1, b.count(t, "txbox_dlq", "reason = $1 AND error LIKE 'dedup key of 3000 bytes is over the 1024-byte limit%'", inbox.ReasonNoID))
	require.Equal(t, 2, b.count(t, "txbox_dlq", "reason = $1", inbox.ReasonTooLarge))
	require.Equal(t, int64(1), b.calls.Load(), "only the unprocessable message reached the handler")
	require.Equal(t, 0, b.count(t, "effects", ""))
}

// A message that kills the process inside the handler never returns an error; the attempt
// counter, committed before the handler ran, still reaches the limit.
func TestAttemptsAreCountedBeforeTheHandlerRuns(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	crash := errors.New("process died")
	h := b.inbox.Middleware(func(*message.Message) ([]*message.Message, error) {
		b.calls.Add(1)
		panic(crash)
	})
	msg := newMessage()
	for range 3 {
		require.PanicsWithValue(t, crash, func() { _ = deliver(h, msg) })
	}
	require.NoError(t, deliver(h, msg))
	require.Equal(t, int64(3), b.calls.Load())
	require.Equal(t, 1, b.count(t, "txbox_dlq", "reason = $1", inbox.ReasonAttemptsExhausted))
}

// A panic in a handler crashes nothing: Watermill's router recovers it and nacks the message. The
// inbox lets the panic pass without ending the attempt, as it would a crash, so the message runs
// alone at its redeliveries and each panic counts: after MaxAttempts of them, in the one process,
// it is dead-lettered, with no last error (the panic is in the router's log). A message delivered
// beside it is processed, and the router runs on.
func TestAHandlerPanicInARouterCountsAsAnAttempt(t *testing.T) {
	t.Parallel()
	b := setup(t, nil) // MaxAttempts: 3
	pubsub, router := newRouter(t)
	router.AddMiddleware(b.inbox.Middleware)
	poison, healthy := newMessage(), newMessage()
	var poisonRuns atomic.Int64
	h := b.handler(func(msg *message.Message) error {
		if msg.UUID == poison.UUID {
			poisonRuns.Add(1)
			panic("poison") // After the handler's insert, which is rolled back.
		}
		return nil
	})
	router.AddConsumerHandler("h", "in", pubsub, func(msg *message.Message) error {
		_, err := h(msg)
		return err
	})
	txtest.RunRouter(t, router)

	require.NoError(t, pubsub.Publish("in", poison, healthy))
	require.Eventually(t, func() bool {
		return b.count(t, "txbox_dlq", "uuid = $1", poison.UUID) == 1 && b.count(t, "effects", "id = $1", healthy.UUID) == 1
	}, time.Minute, 10*time.Millisecond)
	require.Equal(t, 1, b.count(t, "txbox_dlq", "uuid = $1 AND reason = $2 AND attempts = 3 AND error = '3 attempts failed'", poison.UUID, inbox.ReasonAttemptsExhausted))
	require.Equal(t, int64(3), poisonRuns.Load(), "the handler panicked once per attempt")
	require.Zero(t, b.count(t, "effects", "id = $1", poison.UUID), "each panic rolled the handler's writes back")
	require.Zero(t, b.count(t, "txbox_inbox_attempt", ""), "both counters are settled")
	require.False(t, router.IsClosed(), "the router runs on")
}

// Messages a handler returns are written to the outbox in the handler's transaction for its
// publish topic; the router's publisher never sees them.
func TestReturnedMessagesGoThroughTheOutbox(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pubsub, router := newRouter(t)
	router.AddMiddleware(b.inbox.Middleware)
	processed := make(chan struct{}, 1)
	router.AddHandler("h", "in", pubsub, "out", pubsub, func(msg *message.Message) ([]*message.Message, error) {
		defer func() { processed <- struct{}{} }()
		out := newMessage()
		outbox.SetPartitionKey(out, "order-1")
		return []*message.Message{out}, nil
	})
	direct, err := pubsub.Subscribe(context.Background(), "out")
	require.NoError(t, err)
	txtest.RunRouter(t, router)

	require.NoError(t, pubsub.Publish("in", newMessage()))
	<-processed
	require.Eventually(t, func() bool { return b.count(t, "txbox_outbox", "topic = 'out' AND partition_key = 'order-1'") == 1 }, 10*time.Second, 10*time.Millisecond)
	select {
	case m := <-direct:
		t.Fatalf("the router published %s directly", m.UUID)
	default:
	}
}

func TestConfigIsValidated(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	_, err := inbox.New(inbox.Config{DB: env.Pool}, nil)
	require.ErrorContains(t, err, "Config.Consumer")
	_, err = inbox.New(inbox.Config{Consumer: "c"}, nil)
	require.ErrorContains(t, err, "Config.DB")
	_, err = inbox.New(inbox.Config{DB: env.Pool, Consumer: "c", Schema: "Bad-Name"}, nil)
	require.ErrorContains(t, err, "Config.Schema")
	// The database could store no row of such a consumer: every message would fail, forever.
	_, err = inbox.New(inbox.Config{DB: env.Pool, Consumer: "bad\x00name"}, nil)
	require.ErrorContains(t, err, "Config.Consumer")
}

// metric sums a counter family's values.
func metric(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == name {
			var sum float64
			for _, m := range f.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
			return sum
		}
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}
