package relay

import (
	"context"
	"encoding/json"
	"net/url"
	"strconv"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/txbox/txbox/outbox"
)

// tracerName names the relay's spans' instrumentation scope.
const tracerName = "github.com/txbox/txbox/relay"

// Span attributes of the relay; OpenTelemetry's messaging and HTTP conventions where they have a
// name, txbox.* otherwise.
const (
	attrShard     = attribute.Key("txbox.shard")
	attrToken     = attribute.Key("txbox.fencing_token")
	attrIdemKey   = attribute.Key("txbox.idempotency_key")
	attrCallName  = attribute.Key("txbox.call.name")
	attrAttempt   = attribute.Key("txbox.call.attempt")
	attrOutcome   = attribute.Key("txbox.call.outcome")
	attrDLQReason = attribute.Key("txbox.dlq.reason")
)

// startPublishSpans starts a producer span per message, each continuing the trace that the writer's
// context left in the row's metadata (outbox.Writer.Publish), and puts the span's own context in
// the message's metadata, so the consumer's span is its child. The row keeps the writer's context:
// a message published again (after a crash, by another relay) gets a sibling span.
func (l *lease) startPublishSpans(msgs []Message) []trace.Span {
	r := l.relay
	prop := otel.GetTextMapPropagator()
	spans := make([]trace.Span, len(msgs))
	for i := range msgs {
		m := &msgs[i]
		carrier := propagation.MapCarrier(m.Msg.Metadata)
		attrs := []attribute.KeyValue{
			attribute.String("messaging.operation.type", "publish"),
			attribute.String("messaging.destination.name", m.Topic),
			attribute.String("messaging.message.id", m.Msg.UUID),
			attrShard.Int(l.shard),
			attrToken.Int64(l.token),
		}
		if r.kafka {
			attrs = append(attrs, attribute.String("messaging.system", "kafka"))
			if m.Key != "" {
				attrs = append(attrs, attribute.String("messaging.kafka.message.key", m.Key))
			}
		}
		ctx, span := r.tracer.Start(prop.Extract(l.ctx, carrier), "publish "+m.Topic,
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
		prop.Inject(ctx, carrier)
		spans[i] = span
	}
	return spans
}

// endPublishSpans ends the spans of msgs: with where the broker put each message, or with err.
func endPublishSpans(spans []trace.Span, msgs []Message, err error) {
	for i, span := range spans {
		switch {
		case err != nil:
			span.RecordError(err)
			span.SetStatus(codes.Error, "not published")
		case msgs[i].Partition >= 0:
			span.SetAttributes(
				attribute.String("messaging.destination.partition.id", strconv.Itoa(int(msgs[i].Partition))),
				attribute.Int64("messaging.kafka.offset", msgs[i].Offset),
			)
		}
		span.End()
	}
}

// startCallSpan starts the client span of one send of a call, continuing the trace that the
// handler's context left in the call's metadata (outbox.Writer.Call). It carries the idempotency
// key and never the API key, nor the request's parameters.
func (c *caller) startCallSpan(ctx context.Context, row callRow, req outbox.CallRequest, attempt int) (context.Context, trace.Span) {
	var meta map[string]string
	_ = json.Unmarshal([]byte(row.metadata), &meta) // Written by the outbox from a map: it decodes.
	parent := otel.GetTextMapPropagator().Extract(ctx, propagation.MapCarrier(meta))
	attrs := []attribute.KeyValue{
		attribute.String("http.request.method", req.Method),
		attribute.String("url.path", req.Path),
		attrIdemKey.String(row.key),
		attrCallName.String(req.Name),
		attrAttempt.Int(attempt),
		attrShard.Int(c.l.shard),
		attrToken.Int64(c.l.token),
	}
	if u, err := url.Parse(c.cfg.BaseURL); err == nil {
		attrs = append(attrs, attribute.String("server.address", u.Hostname()))
	}
	return c.l.relay.tracer.Start(parent, req.Method+" "+req.Path,
		trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs...))
}

// endCallSpan records what the send came to. The verdict's detail is left out: it quotes the
// provider's error messages, which are not the relay's to copy into a tracing backend.
func endCallSpan(span trace.Span, v verdict) {
	span.SetAttributes(attrOutcome.String(v.label()))
	if v.httpStatus != 0 {
		span.SetAttributes(attribute.Int("http.response.status_code", v.httpStatus))
	}
	switch v.kind {
	case verdictDead:
		span.SetAttributes(attrDLQReason.String(v.reason))
		span.SetStatus(codes.Error, v.reason)
	case verdictRetry, verdictAbandon:
		span.SetStatus(codes.Error, v.label())
	}
	span.End()
}
