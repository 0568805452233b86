package relay_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/stripetest"
)

// The propagator is process-wide; the outbox, the relay and the inbox all use the global one.
var setPropagator = sync.OnceFunc(func() { otel.SetTextMapPropagator(propagation.TraceContext{}) })

func attr(s tracetest.SpanStub, key string) (attribute.Value, bool) {
	for _, kv := range s.Attributes {
		if string(kv.Key) == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

func hasEvent(s tracetest.SpanStub, name string) bool {
	for _, e := range s.Events {
		if e.Name == name {
			return true
		}
	}
	return false
}

// One message, written under a root span, published by the real relay to Kafka, delivered twice to
// one inbox handler (two consumer groups), whose handler enqueues a Stripe call: the trace shows
// root → publish (producer) → two process spans (consumer), one "processed" and one with a
// "duplicate" event, and the processed one → the call's client span carrying the idempotency key
// and never the API key.
func TestTraceFollowsAMessageFromWriterToStripe(t *testing.T) {
	t.Parallel()
	setPropagator()
	b := setup(t)
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	const secret = "sk_test_trace_secret_do_not_export"
	double := stripetest.New(stripetest.Options{APIKey: secret})
	t.Cleanup(double.Close)
	b.startRelay(t, func(c *relay.Config) {
		c.TracerProvider = tp
		c.Calls = &relay.CallConfig{
			APIKey: secret, BaseURL: double.URL(),
			HTTPClient:   &http.Client{Transport: &http.Transport{DisableKeepAlives: true}},
			PollInterval: 10 * time.Millisecond,
		}
	})

	ib, err := inbox.New(inbox.Config{DB: b.env.Pool, Consumer: "billing", Schema: b.env.Schema,
		Delivery: kafkasub.Delivery, TracerProvider: tp}, nil)
	require.NoError(t, err)
	keys := make(chan string, 4)
	charge := func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		key, err := b.writer.Call(msg.Context(), tx, outbox.Call{Name: "charge", Path: "/v1/charges",
			Params: url.Values{"amount": {"500"}, "currency": {"eur"}, "source": {"tok_visa"}}})
		if err == nil {
			keys <- key
		}
		return err
	}
	// Two consumer groups deliver the message twice to the same (consumer, handler).
	for _, group := range []string{"first", "second"} {
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddMiddleware(ib.Middleware)
		router.AddConsumerHandler("charge", b.topic, kafkatest.NewSubscriber(t, group+"-"+b.env.Schema), charge)
		txtest.RunRouter(t, router)
	}

	ctx, root := tp.Tracer("test").Start(context.Background(), "place order")
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"o-1"}`))
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, b.writer.Publish(ctx, tx, b.topic, msg))
	require.NoError(t, tx.Commit(ctx))
	root.End()

	var key string
	select {
	case key = <-keys:
	case <-time.After(60 * time.Second):
		t.Fatal("the handler never ran")
	}
	require.Eventually(t, func() bool { return double.ChargesFor(key) == 1 }, 30*time.Second, 20*time.Millisecond)

	byKind := func(kind trace.SpanKind) []tracetest.SpanStub {
		var out []tracetest.SpanStub
		for _, s := range exporter.GetSpans() {
			if s.SpanKind == kind {
				out = append(out, s)
			}
		}
		return out
	}
	require.Eventually(t, func() bool {
		return len(byKind(trace.SpanKindConsumer)) >= 2 && len(byKind(trace.SpanKindClient)) >= 1
	}, 30*time.Second, 20*time.Millisecond, "two process spans and a call span")

	traceID := root.SpanContext().TraceID()
	publishes := byKind(trace.SpanKindProducer)
	require.Len(t, publishes, 1, "one publish")
	pub := publishes[0]
	require.Equal(t, traceID, pub.SpanContext.TraceID())
	require.Equal(t, root.SpanContext().SpanID(), pub.Parent.SpanID(), "the relay continues the writer's trace")
	for k, want := range map[string]string{"messaging.system": "kafka", "messaging.destination.name": b.topic, "messaging.message.id": msg.UUID} {
		v, ok := attr(pub, k)
		require.True(t, ok, k)
		require.Equal(t, want, v.AsString(), k)
	}
	for _, k := range []string{"txbox.shard", "txbox.fencing_token", "messaging.kafka.offset"} {
		v, ok := attr(pub, k)
		require.True(t, ok, k)
		require.GreaterOrEqual(t, v.AsInt64(), int64(0), k)
	}
	token, _ := attr(pub, "txbox.fencing_token")
	require.Positive(t, token.AsInt64())
	partition, ok := attr(pub, "messaging.destination.partition.id")
	require.True(t, ok)
	require.NotEmpty(t, partition.AsString())

	var processed, duplicates []tracetest.SpanStub
	for _, s := range byKind(trace.SpanKindConsumer) {
		require.Equal(t, traceID, s.SpanContext.TraceID())
		require.Equal(t, pub.SpanContext.SpanID(), s.Parent.SpanID(), "a process span is a child of the publish span")
		for k, want := range map[string]string{"messaging.message.id": msg.UUID, "txbox.consumer": "billing", "txbox.handler": "charge", "txbox.dedup_key": msg.UUID} {
			v, ok := attr(s, k)
			require.True(t, ok, k)
			require.Equal(t, want, v.AsString(), k)
		}
		switch {
		case hasEvent(s, "processed"):
			require.False(t, hasEvent(s, "duplicate"))
			processed = append(processed, s)
		case hasEvent(s, "duplicate"):
			duplicates = append(duplicates, s)
		default:
			t.Errorf("process span %s has neither a processed nor a duplicate event: %v", s.Name, s.Events)
		}
	}
	require.Len(t, processed, 1, "one delivery processed the message")
	require.NotEmpty(t, duplicates, "the other delivery shows as a duplicate")

	calls := byKind(trace.SpanKindClient)
	require.Len(t, calls, 1)
	call := calls[0]
	require.Equal(t, traceID, call.SpanContext.TraceID())
	require.Equal(t, processed[0].SpanContext.SpanID(), call.Parent.SpanID(), "the call continues the processing that enqueued it")
	v, ok := attr(call, "txbox.idempotency_key")
	require.True(t, ok)
	require.Equal(t, key, v.AsString())
	status, ok := attr(call, "http.response.status_code")
	require.True(t, ok)
	require.Equal(t, int64(200), status.AsInt64())

	// No span says anything about the API key.
	for _, s := range exporter.GetSpans() {
		dump := fmt.Sprintf("%s %v %v %v", s.Name, s.Attributes, s.Events, s.Status)
		require.NotContains(t, dump, secret)
		require.NotContains(t, strings.ToLower(dump), "authorization")
	}
}
