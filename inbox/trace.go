package inbox

import (
	"context"
	"errors"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/txbox/txbox/outbox"
)

// tracerName names the inbox's spans' instrumentation scope.
const tracerName = "github.com/txbox/txbox/inbox"

// Events on a delivery's span: exactly one delivery of a message per handler is "processed"; the
// others are "duplicate" (or the message was "dead_lettered").
const (
	eventProcessed    = "processed"
	eventDuplicate    = "duplicate"
	eventDeadLettered = "dead_lettered"
)

const (
	attrDedupKey  = attribute.Key("txbox.dedup_key")
	attrAttempt   = attribute.Key("txbox.attempt")
	attrDLQReason = attribute.Key("txbox.dlq.reason")
)

// startSpan starts the consumer span of one delivery, continuing the trace in the message's
// metadata.
func (ib *Inbox) startSpan(msg *message.Message, sc scope) (context.Context, trace.Span) {
	ctx := otel.GetTextMapPropagator().Extract(msg.Context(), propagation.MapCarrier(msg.Metadata))
	topic := message.SubscribeTopicFromCtx(ctx)
	attrs := []attribute.KeyValue{
		attribute.String("messaging.operation.type", "process"),
		attribute.String("messaging.destination.name", topic),
		attribute.String("messaging.message.id", msg.UUID),
		attribute.String("txbox.consumer", sc.consumer),
		attribute.String("txbox.handler", sc.handler),
	}
	if key := msg.Metadata.Get(outbox.PartitionKeyMetadata); key != "" {
		attrs = append(attrs, attribute.String("messaging.kafka.message.key", key))
	}
	if ib.cfg.Delivery != nil {
		if partition, offset, ok := ib.cfg.Delivery(ctx); ok {
			attrs = append(attrs, attribute.String("messaging.destination.partition.id", strconv.Itoa(int(partition))),
				attribute.Int64("messaging.kafka.offset", offset))
		}
	}
	return ib.tracer.Start(ctx, "process "+topic, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
}

// endSpan ends a delivery's span; err is what the inbox returned to the router.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		status := "handler failed"
		if errors.Is(err, context.Canceled) {
			status = "cancelled"
		}
		span.SetStatus(codes.Error, status)
	}
	span.End()
}
