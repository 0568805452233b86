package inbox_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/migrations"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// rig is a real Watermill router over a gochannel pub/sub with the inbox added router-wide, as the
// README shows. Handlers record one row per processing in handled(handler, uuid).
type rig struct {
	*bundle
	pubsub *gochannel.GoChannel
	router *message.Router
	acked  atomic.Int64 // deliveries the middleware chain acknowledged
}

func newRig(t *testing.T, mutate func(*inbox.Config)) *rig {
	t.Helper()
	r := &rig{bundle: setup(t, mutate)}
	_, err := r.env.Pool.Exec(context.Background(), "CREATE TABLE "+r.env.Q("handled")+" (handler text NOT NULL, uuid text NOT NULL)")
	require.NoError(t, err)
	r.pubsub = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	r.router = r.newRouter(t)
	return r
}

// newRouter returns a router with the rig's inbox added router-wide, behind a middleware that
// counts acknowledged deliveries.
func (r *rig) newRouter(t *testing.T) *message.Router {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				r.acked.Add(1)
			}
			return out, err
		}
	}, r.inbox.Middleware)
	return router
}

// record is a handler that applies its business effect in the inbox's transaction.
func (r *rig) record(msg *message.Message) error {
	tx, ok := inbox.TxFromContext(msg.Context())
	if !ok {
		return fmt.Errorf("no transaction in the handler's context")
	}
	_, err := tx.Exec(msg.Context(), "INSERT INTO "+r.env.Q("handled")+" VALUES ($1, $2)", message.HandlerNameFromCtx(msg.Context()), msg.UUID)
	return err
}

func (r *rig) run(t *testing.T) { txtest.RunRouter(t, r.router) }

// waitAcked waits until n deliveries were acknowledged: every copy has been settled by the inbox,
// processed or skipped.
func (r *rig) waitAcked(t *testing.T, n int64) {
	t.Helper()
	require.Eventually(t, func() bool { return r.acked.Load() >= n }, 20*time.Second, 5*time.Millisecond)
}

// handledBy returns how often each handler processed each message: handler → uuid → count.
func (r *rig) handledBy(t *testing.T) map[string]map[string]int {
	t.Helper()
	rows, err := r.env.Pool.Query(context.Background(), "SELECT handler, uuid, count(*) FROM "+r.env.Q("handled")+" GROUP BY 1, 2")
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]map[string]int{}
	for rows.Next() {
		var (
			h, u string
			n    int
		)
		require.NoError(t, rows.Scan(&h, &u, &n))
		if out[h] == nil {
			out[h] = map[string]int{}
		}
		out[h][u] = n
	}
	require.NoError(t, rows.Err())
	return out
}

func once(uuids ...string) map[string]int {
	m := map[string]int{}
	for _, u := range uuids {
		m[u] = 1
	}
	return m
}

// The README adds the inbox router-wide. Two handlers on one topic must each process every message
// once: deduplication is per consuming handler, not per service.
func TestEveryHandlerOfATopicProcessesEachMessageOnce(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil)
	r.router.AddConsumerHandler("charge", "orders.placed", r.pubsub, r.record)
	r.router.AddConsumerHandler("email", "orders.placed", r.pubsub, r.record)
	r.run(t)

	var uuids []string
	for range 10 {
		msg := newMessage()
		uuids = append(uuids, msg.UUID)
		require.NoError(t, r.pubsub.Publish("orders.placed", msg))
	}
	r.waitAcked(t, 20)
	// Redeliveries are still skipped, per handler.
	for _, u := range uuids[:3] {
		require.NoError(t, r.pubsub.Publish("orders.placed", message.NewMessage(u, []byte(`{"amount":100}`))))
	}
	r.waitAcked(t, 26)
	require.Equal(t, map[string]map[string]int{"charge": once(uuids...), "email": once(uuids...)}, r.handledBy(t))
	require.Equal(t, 20, r.count(t, "txbox_inbox", "state = 'done' AND handler IN ('charge', 'email')"))
}

// One message id consumed from two topics by two handlers is two processings.
func TestOneIDOnTwoTopicsIsProcessedByEachHandler(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil)
	r.router.AddConsumerHandler("placed", "orders.placed", r.pubsub, r.record)
	r.router.AddConsumerHandler("audited", "orders.audit", r.pubsub, r.record)
	r.run(t)

	msg := newMessage()
	require.NoError(t, r.pubsub.Publish("orders.placed", msg.Copy()))
	require.NoError(t, r.pubsub.Publish("orders.audit", msg.Copy()))
	require.NoError(t, r.pubsub.Publish("orders.audit", msg.Copy())) // a redelivery
	r.waitAcked(t, 3)
	require.Equal(t, map[string]map[string]int{"placed": once(msg.UUID), "audited": once(msg.UUID)}, r.handledBy(t))
}

// A handler forwards what it consumed (same UUID, as Watermill handlers that return the incoming
// message do) through the outbox; its reply handler in the same router consumes that topic. The
// relay moves the outbox rows onto the pub/sub.
func TestAHandlerAndItsReplyHandlerInOneRouter(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil)
	r.router.AddHandler("confirm", "orders.placed", r.pubsub, "orders.confirmed", r.pubsub, func(msg *message.Message) ([]*message.Message, error) {
		if err := r.record(msg); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(msg.UUID, msg.Payload)}, nil
	})
	r.router.AddConsumerHandler("notify", "orders.confirmed", r.pubsub, r.record)
	r.run(t)
	runRelay(t, r.bundle, r.pubsub)

	var uuids []string
	for range 5 {
		msg := newMessage()
		uuids = append(uuids, msg.UUID)
		require.NoError(t, r.pubsub.Publish("orders.placed", msg))
	}
	r.waitAcked(t, 10)
	require.Eventually(t, func() bool { return r.count(t, "txbox_outbox", "") == 0 }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, map[string]map[string]int{"confirm": once(uuids...), "notify": once(uuids...)}, r.handledBy(t))
}

// pubsubSink publishes the relay's messages to a Watermill publisher, for tests without Kafka.
type pubsubSink struct{ pub message.Publisher }

func (s pubsubSink) Open(context.Context, int, int64) (relay.ShardPublisher, error) { return s, nil }
func (pubsubSink) Close() error                                                     { return nil }

func (s pubsubSink) Publish(_ context.Context, msgs []relay.Message) error {
	for _, m := range msgs {
		if err := s.pub.Publish(m.Topic, m.Msg); err != nil {
			return err
		}
	}
	return nil
}

func runRelay(t *testing.T, b *bundle, pub message.Publisher) {
	t.Helper()
	rl, err := relay.New(relay.Config{
		DB: b.env.Pool, Sink: pubsubSink{pub}, Schema: b.env.Schema, Shards: 1,
		PollInterval: 5 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rl.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })
}

// migrateTo moves the test's schema to migration version v, up or down.
func migrateTo(t *testing.T, b *bundle, v int64) {
	t.Helper()
	ctx := context.Background()
	db := stdlib.OpenDBFromPool(b.env.Pool)
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db, migrations.WithSchema(b.env.Schema))
	require.NoError(t, err)
	cur, err := p.GetDBVersion(ctx)
	require.NoError(t, err)
	if v < cur {
		_, err = p.DownTo(ctx, v)
	} else {
		_, err = p.UpTo(ctx, v)
	}
	require.NoError(t, err)
}

// Rows written before deduplication was per handler were recorded for the whole consumer: after
// the upgrade a redelivery of such a message is skipped by every handler, and a dead letter from
// before is redriven to the handlers as one message.
func TestConsumerWideRowsFromBeforeTheUpgradeAreHonoured(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil)
	ctx := context.Background()
	migrateTo(t, r.bundle, 1)
	processed, dead := newMessage(), newMessage()
	_, err := r.env.Pool.Exec(ctx, "INSERT INTO "+r.env.Q("txbox_inbox")+` (consumer, dedup_key, message_uuid, topic, state)
		VALUES ('billing', $1, $1, 'orders.placed', 'done'), ('billing', $2, $2, 'orders.placed', 'dead')`, processed.UUID, dead.UUID)
	require.NoError(t, err)
	_, err = r.env.Pool.Exec(ctx, "INSERT INTO "+r.env.Q("txbox_dlq")+` (source, topic, consumer, dedup_key, uuid, payload, reason)
		VALUES ('inbox', 'orders.placed', 'billing', $1, $1, '{}', 'attempts exhausted')`, dead.UUID)
	require.NoError(t, err)
	migrateTo(t, r.bundle, math.MaxInt64) // the upgrade: to the current version, which the inbox needs

	r.router.AddConsumerHandler("charge", "orders.placed", r.pubsub, r.record)
	r.router.AddConsumerHandler("email", "orders.placed", r.pubsub, r.record)
	r.run(t)
	fresh := newMessage()
	for _, m := range []*message.Message{processed, dead, fresh} {
		require.NoError(t, r.pubsub.Publish("orders.placed", m.Copy()))
	}
	r.waitAcked(t, 6)
	require.Equal(t, map[string]map[string]int{"charge": once(fresh.UUID), "email": once(fresh.UUID)}, r.handledBy(t),
		"the messages settled before the upgrade are skipped by both handlers")
	require.Zero(t, r.count(t, "txbox_inbox_attempt", "dedup_key IN ($1, $2)", processed.UUID, dead.UUID))

	// The old letter is redriven: its consumer-wide dead row goes, and each handler processes it.
	admin, err := dlq.NewAdmin(dlq.AdminConfig{Schema: r.env.Schema})
	require.NoError(t, err)
	res, err := admin.Redrive(ctx, r.env.Pool, dlq.Filter{Consumer: "billing"}, dlq.RedriveOptions{Rate: rate.Inf})
	require.NoError(t, err)
	require.Equal(t, 1, res.Released)
	require.NoError(t, r.pubsub.Publish("orders.placed", dead.Copy()))
	r.waitAcked(t, 8)
	require.Equal(t, map[string]map[string]int{"charge": once(fresh.UUID, dead.UUID), "email": once(fresh.UUID, dead.UUID)}, r.handledBy(t))
}

// Two handlers of one consumer writing a call of the same name for the same message get keys of
// their own; each keeps its key when its message is processed again.
func TestCallsOfTwoHandlersGetTheirOwnKeys(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil)
	w, err := outbox.New(outbox.Config{Schema: r.env.Schema})
	require.NoError(t, err)
	call := func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := w.Call(msg.Context(), tx, outbox.Call{Name: "charge", Path: "/v1/charges", Params: url.Values{"amount": {"100"}}})
		return err
	}
	r.router.AddConsumerHandler("charge", "orders.placed", r.pubsub, call)
	r.router.AddConsumerHandler("email", "orders.placed", r.pubsub, call)
	r.run(t)
	msg := newMessage()
	require.NoError(t, r.pubsub.Publish("orders.placed", msg))
	r.waitAcked(t, 2)

	key := func(handler string) string {
		return outbox.IdempotencyKey(outbox.Source{Consumer: "billing", Handler: handler, DedupKey: msg.UUID}, "charge")
	}
	require.NotEqual(t, key("charge"), key("email"))
	require.Equal(t, 1, r.count(t, "txbox_outbox", "kind = 'call' AND idempotency_key = $1", key("charge")))
	require.Equal(t, 1, r.count(t, "txbox_outbox", "kind = 'call' AND idempotency_key = $1", key("email")))
}

// countingTracer counts the round trips a pool makes for messages: each statement, begin and
// commit included, and each batch of statements. The dedup counts' background write, one per
// StatsInterval and not part of any message's path, is not counted.
type countingTracer struct{ n atomic.Int64 }

func (c *countingTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (*countingTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (*countingTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if !strings.Contains(d.SQL, "txbox_dedup_stats") {
		c.n.Add(1)
	}
	return ctx
}
func (*countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// Honouring consumer-wide rows costs no round trip: a message in a router handler (checked against
// its handler's row and the consumer-wide one) costs the inbox as many statements as one outside a
// router, fresh or duplicate.
func TestHonouringConsumerWideRowsCostsNoRoundTrip(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	cfg, err := pgxpool.ParseConfig(b.env.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	tracer := &countingTracer{}
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ib, err := inbox.New(inbox.Config{DB: pool, Consumer: "billing", Schema: b.env.Schema}, nil)
	require.NoError(t, err)
	noop := func(*message.Message) ([]*message.Message, error) { return nil, nil }

	// statements returns what delivering msg three times (fresh, then a duplicate, then a
	// duplicate again) cost, after another fresh message.
	statements := func(deliverOnce func(*message.Message)) (fresh, duplicate, again int64) {
		deliverOnce(newMessage())
		msg := newMessage()
		var cost [3]int64
		for i := range cost {
			before := tracer.n.Load()
			deliverOnce(msg)
			cost[i] = tracer.n.Load() - before
		}
		return cost[0], cost[1], cost[2]
	}
	outside := ib.Middleware(noop)
	freshOutside, dupOutside, againOutside := statements(func(m *message.Message) { require.NoError(t, deliver(outside, m)) })

	pubsub, router := newRouter(t)
	settled := make(chan error)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			settled <- err
			return out, err
		}
	}, ib.Middleware)
	router.AddConsumerHandler("charge", "orders.placed", pubsub, func(*message.Message) error { return nil })
	txtest.RunRouter(t, router)
	freshInRouter, dupInRouter, againInRouter := statements(func(m *message.Message) {
		require.NoError(t, pubsub.Publish("orders.placed", m.Copy()))
		require.NoError(t, <-settled)
	})

	require.Equal(t, freshOutside, freshInRouter, "statements for a fresh message")
	require.Equal(t, dupOutside, dupInRouter, "statements for a duplicate")
	require.Equal(t, againOutside, againInRouter, "statements for a duplicate after a duplicate")
	// Mark the attempt and commit it; begin, take the generation lock and insert the inbox row
	// (clearing the counter): one batch; then commit. A duplicate: the batch, and the rollback of
	// the transaction it opened. A duplicate after a duplicate, expected to be one: the marker
	// alone, which writes nothing.
	require.Equal(t, int64(2), freshInRouter)
	require.Equal(t, int64(2), dupInRouter)
	require.Equal(t, int64(1), againInRouter)
}

// Names and ids at their limits together (a consumer and a handler name of MaxNameBytes, an id of
// MaxDedupKeyBytes) fit the inbox's rows and the dead-letter table; a longer handler name fails
// every delivery, naming the limit, and leaves its message for a renamed handler. Before, a long
// consumer name made a message of a 1,024-byte id fail every delivery at the index, neither
// processed nor dead-lettered.
func TestNamesAtTheirLimitsFitAndLongerHandlerNamesAreRefused(t *testing.T) {
	t.Parallel()
	r := newRig(t, func(c *inbox.Config) { c.Consumer = strings.Repeat("c", inbox.MaxNameBytes) })
	_, err := inbox.New(inbox.Config{DB: r.env.Pool, Consumer: strings.Repeat("c", inbox.MaxNameBytes+1)}, nil)
	require.ErrorContains(t, err, "Config.Consumer of 257 bytes")

	long := strings.Repeat("h", inbox.MaxNameBytes)
	r.router.AddConsumerHandler(long, "orders", r.pubsub, func(msg *message.Message) error {
		if msg.Metadata.Get("poison") != "" {
			return inbox.ErrUnprocessable
		}
		return r.record(msg)
	})
	// A router of its own, whose middleware sees what the inbox returns.
	refused := make(chan error, 1)
	other, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	other.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			select {
			case refused <- err:
			default:
			}
			return out, err
		}
	}, r.inbox.Middleware)
	other.AddConsumerHandler(strings.Repeat("h", inbox.MaxNameBytes+1), "payments", r.pubsub, func(*message.Message) error { return nil })
	r.run(t)
	txtest.RunRouter(t, other)
	<-r.router.Running()
	<-other.Running()

	id := strings.Repeat("i", inbox.MaxDedupKeyBytes)
	poison := message.NewMessage(strings.Repeat("p", inbox.MaxDedupKeyBytes), []byte("{}"))
	poison.Metadata.Set("poison", "yes")
	require.NoError(t, r.pubsub.Publish("orders", message.NewMessage(id, []byte("{}")), message.NewMessage(id, []byte("{}")), poison))
	r.waitAcked(t, 3)
	require.Equal(t, map[string]map[string]int{long: once(id)}, r.handledBy(t), "processed once, its copy skipped")
	require.Equal(t, 1, r.count(t, "txbox_dlq", "reason = $1", inbox.ReasonUnprocessable))

	require.NoError(t, r.pubsub.Publish("payments", message.NewMessage("m-1", []byte("{}"))))
	select {
	case err := <-refused:
		require.ErrorContains(t, err, "over the 256-byte limit (inbox.MaxNameBytes); rename the handler")
	case <-time.After(20 * time.Second):
		t.Fatal("the delivery to the handler with the long name did not end")
	}
	require.Zero(t, r.count(t, "txbox_inbox", "handler = $1", strings.Repeat("h", inbox.MaxNameBytes+1)), "nothing recorded")
}
