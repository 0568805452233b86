package outbox_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

type row struct {
	topic, key, uuid string
	slot             int16
	payload          []byte
	metadata         map[string]string
}

func rows(t *testing.T, env *txtest.Env) []row {
	t.Helper()
	rs, err := env.Pool.Query(context.Background(),
		"SELECT topic, partition_key, uuid, slot, payload, metadata::text FROM "+env.Q("txbox_outbox")+" WHERE kind = 'message' ORDER BY id")
	require.NoError(t, err)
	defer rs.Close()
	var out []row
	for rs.Next() {
		var r row
		var meta string
		require.NoError(t, rs.Scan(&r.topic, &r.key, &r.uuid, &r.slot, &r.payload, &meta))
		require.NoError(t, json.Unmarshal([]byte(meta), &r.metadata))
		out = append(out, r)
	}
	require.NoError(t, rs.Err())
	return out
}

func TestPublishWritesInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	ctx := context.Background()

	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	first := outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), []byte("a")), "order-1")
	first.Metadata.Set("customer", "c-9")
	second := outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), nil), "order-1")
	require.NoError(t, w.Publish(ctx, tx, "orders", first, second))
	require.Empty(t, rows(t, env), "invisible before commit")
	require.NoError(t, tx.Rollback(ctx))
	require.Empty(t, rows(t, env), "gone with the rollback")

	tx, err = env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, w.Publish(ctx, tx, "orders", first, second))
	require.NoError(t, tx.Commit(ctx))
	got := rows(t, env)
	require.Len(t, got, 2)
	require.Equal(t, []string{first.UUID, second.UUID}, []string{got[0].uuid, got[1].uuid}, "call order kept")
	require.Equal(t, "orders", got[0].topic)
	require.Equal(t, "order-1", got[0].key)
	require.Equal(t, outbox.SlotOf("order-1", ""), got[0].slot)
	require.Equal(t, got[0].slot, got[1].slot, "one key, one slot")
	require.Equal(t, []byte("a"), got[0].payload)
	require.Equal(t, []byte{}, got[1].payload)
	require.Equal(t, "c-9", got[0].metadata["customer"])
}

func TestPublisherIsAWatermillPublisherOverTheTransaction(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	ctx := context.Background()
	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	var pub message.Publisher = w.Publisher(ctx, tx)
	require.NoError(t, pub.Publish("events", message.NewMessage(watermill.NewUUID(), []byte("x"))))
	require.NoError(t, pub.Close())
	require.NoError(t, tx.Commit(ctx))
	require.Len(t, rows(t, env), 1)
}

// sampledSpanContext returns a context carrying a sampled span, and installs the W3C trace-context
// propagator for the test: the outbox stores it as the traceparent below.
func sampledSpanContext(t *testing.T) context.Context {
	t.Helper()
	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	withPropagator(t, propagation.TraceContext{})
	return trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled,
	}))
}

func TestPublishStoresTheTraceContext(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	ctx := sampledSpanContext(t)
	require.NoError(t, w.Publish(ctx, env.Pool, "events", message.NewMessage(watermill.NewUUID(), nil)))
	got := rows(t, env)
	require.Len(t, got, 1)
	require.Equal(t, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", got[0].metadata["traceparent"])
}

// Each message's metadata lands on its own row, whole, through both statements Publish uses (one
// message, several), and the trace context replaces a caller's key of the same name.
func TestPublishStoresEachMessagesMetadata(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	ctx := sampledSpanContext(t)
	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

	var msgs []*message.Message
	for i, md := range []message.Metadata{
		{},
		{"customer": `c-"9"\`, "note": "tab\tnewline\n ünïcødé 😀 <&>"},
		{outbox.PartitionKeyMetadata: "order-1", "traceparent": "stale"},
	} {
		msg := message.NewMessage(fmt.Sprint("m-", i), nil)
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
		msgs = append(msgs, msg)
	}
	require.NoError(t, w.Publish(ctx, env.Pool, "one-call", msgs...))
	for _, msg := range msgs {
		require.NoError(t, w.Publish(ctx, env.Pool, "one-each", msg))
	}

	got := rows(t, env)
	require.Len(t, got, 2*len(msgs))
	for i, r := range got {
		msg := msgs[i%len(msgs)]
		require.Equal(t, msg.UUID, r.uuid)
		want := map[string]string{"traceparent": traceparent}
		for k, v := range msg.Metadata {
			if k != "traceparent" {
				want[k] = v
			}
		}
		require.Equal(t, want, r.metadata, "row %d (%s)", i, r.topic)
	}
}

func TestInvalidMessagesAreRefusedWholesale(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema, MaxPayloadBytes: 10})
	require.NoError(t, err)
	ok := message.NewMessage(watermill.NewUUID(), nil)
	reserved := message.NewMessage(watermill.NewUUID(), nil)
	reserved.Metadata.Set("_watermill_message_uuid", "x")
	badMeta := message.NewMessage(watermill.NewUUID(), nil)
	badMeta.Metadata.Set("k", "\xff")
	for name, tc := range map[string]struct {
		topic string
		msg   *message.Message
		want  string
	}{
		"no topic":     {"", ok, "empty topic"},
		"no uuid":      {"t", message.NewMessage("", nil), "empty UUID"},
		"reserved key": {"t", reserved, "reserved"},
		"too large":    {"t", message.NewMessage(watermill.NewUUID(), make([]byte, 11)), "over the 10-byte limit"},
		"nil":          {"t", nil, "nil message"},
		"long uuid": {"t", message.NewMessage(strings.Repeat("u", outbox.MaxUUIDBytes+1), nil),
			"UUID of 1025 bytes is over the 1024-byte limit"},
		"binary uuid":  {"t", message.NewMessage("a\x00b", nil), "not valid UTF-8 or contains NUL"},
		"binary meta":  {"t", badMeta, "metadata"},
		"NUL in topic": {"t\x00", ok, "topic"},
		"binary topic": {"t\xff", ok, "topic"},
		"binary partition key": {"t", outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), nil), "\xff"),
			outbox.PartitionKeyMetadata},
	} {
		err := w.Publish(context.Background(), env.Pool, tc.topic, ok, tc.msg)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, name)
		require.ErrorContains(t, err, tc.want, name)
		if tc.topic == "t" { // The message, not the topic, is at fault.
			require.ErrorContains(t, err, "(message 2 of 2; nothing was written)", name)
		}
	}
	require.Empty(t, rows(t, env), "nothing written when any message is invalid")
}

func TestANilTxIsAnErrorNotAPanic(t *testing.T) {
	t.Parallel()
	w, err := outbox.New(outbox.Config{})
	require.NoError(t, err)
	ctx := outbox.ContextWithSource(context.Background(), outbox.Source{Consumer: "payments", DedupKey: "msg-1"})
	for name, tx := range map[string]outbox.Execer{"nil": nil, "nil pgx.Tx": pgx.Tx(nil), "nil pool": (*pgxpool.Pool)(nil),
		"FromSQL of a nil *sql.Tx": outbox.FromSQL((*sql.Tx)(nil)), "FromSQL of nil": outbox.FromSQL(nil)} {
		require.ErrorContains(t, w.Publish(ctx, tx, "t", message.NewMessage(watermill.NewUUID(), nil)), "tx is", name)
		_, err := w.Call(ctx, tx, outbox.Call{Name: "charge", Path: "/v1/charges"})
		require.ErrorContains(t, err, "tx is", name)
	}
}

func TestConfigIsValidated(t *testing.T) {
	t.Parallel()
	_, err := outbox.New(outbox.Config{Schema: "no; DROP TABLE x"})
	require.ErrorContains(t, err, "Config.Schema")
	_, err = outbox.New(outbox.Config{MaxPayloadBytes: -1})
	require.ErrorContains(t, err, "Config.MaxPayloadBytes")
}

func TestSlotsSpreadKeys(t *testing.T) {
	t.Parallel()
	used := map[int16]bool{}
	for i := range 10000 {
		s := outbox.SlotOf(fmt.Sprint("key-", i), "")
		require.True(t, s >= 0 && s < outbox.Slots)
		used[s] = true
	}
	require.Len(t, used, outbox.Slots, "10k keys reach every slot")
	require.Equal(t, outbox.SlotOf("", "uuid-1"), outbox.SlotOf("uuid-1", ""), "keyless messages spread by UUID")
}
