package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"maps"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

// FuzzToMessage: whatever an outbox row holds, turning it into a message never panics, carries the
// row's topic, key, UUID and payload, stamps the lease's shard and token over any the row had, and
// keeps every other metadata entry that decodes.
func FuzzToMessage(f *testing.F) {
	f.Add("orders", "order-7", "0b6c1f0e-6f38-4a55-9c3c-5e0f8f0a1b2c", []byte(`{"n":1}`), `{"a": "b", "txbox_partition_key": "order-7"}`, 3, int64(42))
	f.Add("", "", "", []byte{}, `{}`, 0, int64(0))
	f.Add("t", "k", "u", []byte{0, 255}, `null`, 255, int64(-1))
	f.Add("t", "k", "u", []byte(nil), `{"txbox_shard": "99", "txbox_token": "x"}`, 1, int64(1<<62))
	f.Add("t", "k", "u", []byte("x"), `{"a": 1, "b": "kept"}`, 1, int64(1))
	f.Add("t", "k", "u", []byte("x"), `["not", "an", "object"]`, 1, int64(1))
	f.Add("t", "k", "u", []byte("x"), `{"\u00e9": "\ud800", "a": "\u0000"}`, 1, int64(1))
	f.Add("t", "k", "u", []byte("x"), `{"a": "b"`, 1, int64(1))
	f.Fuzz(func(t *testing.T, topic, key, uuid string, payload []byte, metadata string, shard int, token int64) {
		l := &lease{shard: shard, token: token}
		got := l.toMessage(pendingRow{id: 1, topic: topic, partitionKey: key, uuid: uuid, payload: payload, metadata: metadata})
		if got.Topic != topic || got.Key != key || got.Msg.UUID != uuid || !bytes.Equal(got.Msg.Payload, payload) {
			t.Fatalf("row (%q, %q, %q, %q) became (%q, %q, %q, %q)", topic, key, uuid, payload, got.Topic, got.Key, got.Msg.UUID, got.Msg.Payload)
		}
		if s, tok := got.Msg.Metadata.Get(outbox.ShardMetadata), got.Msg.Metadata.Get(outbox.TokenMetadata); s != strconv.Itoa(shard) || tok != strconv.FormatInt(token, 10) {
			t.Fatalf("lease (%d, %d) stamped as (%q, %q)", shard, token, s, tok)
		}
		var want map[string]string
		if json.Unmarshal([]byte(metadata), &want) != nil {
			return // Not from the outbox; only the above is promised.
		}
		if want == nil {
			want = map[string]string{}
		}
		want[outbox.ShardMetadata], want[outbox.TokenMetadata] = strconv.Itoa(shard), strconv.FormatInt(token, 10)
		if !maps.Equal(map[string]string(got.Msg.Metadata), want) {
			t.Fatalf("metadata %s became %v, want %v", metadata, got.Msg.Metadata, want)
		}
	})
}

// FuzzMetadataRoundTrip: metadata the outbox accepts reaches the relay's message unchanged, through
// PostgreSQL's jsonb (which reorders keys, drops and changes escapes) and the relay's own read
// query; what the outbox refuses, it refuses with an error at write time.
func FuzzMetadataRoundTrip(f *testing.F) {
	env := txtest.New(f)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	if err != nil {
		f.Fatal(err)
	}
	schema, err := sqlname.Schema(env.Schema)
	if err != nil {
		f.Fatal(err)
	}
	read := renderQueries(schema, outbox.Slots).readMessages
	allSlots := slotsOf(0, 1)

	f.Add("u1", "k", "order-7", "note", "<b>&amp;</b>")
	f.Add("u2", "", "", "é", "\u2028\t\"\\")
	f.Add("u3", "txbox_shard", "99", "_watermill_message_uuid", "x")
	f.Add("u4", "a", "\x00", "b", "\xff")
	f.Fuzz(func(t *testing.T, uuid, k1, v1, k2, v2 string) {
		ctx := context.Background()
		msg := message.NewMessage(uuid, []byte("p"))
		msg.Metadata.Set(k1, v1)
		msg.Metadata.Set(k2, v2)
		tx, err := env.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck // Every case is rolled back.
		if err := w.Publish(ctx, tx, "topic", msg); err != nil {
			if !errors.Is(err, outbox.ErrInvalidMessage) {
				t.Logf("refused by PostgreSQL: %v", err) // NUL bytes, invalid UTF-8: refused at write time.
			}
			return
		}
		rows, err := tx.Query(ctx, read, allSlots, 10, DefaultBatchBytes)
		if err != nil {
			t.Fatal(err)
		}
		batch, err := pgx.CollectRows(rows, scanPending)
		if err != nil || len(batch) != 1 {
			t.Fatalf("read back %d rows: %v", len(batch), err)
		}
		got := (&lease{shard: 3, token: 9}).toMessage(batch[0])

		// What the outbox stored is the JSON encoding of the metadata: invalid UTF-8 becomes U+FFFD.
		var want map[string]string
		encoded, _ := json.Marshal(msg.Metadata)
		if err := json.Unmarshal(encoded, &want); err != nil {
			t.Fatal(err)
		}
		want[outbox.ShardMetadata], want[outbox.TokenMetadata] = "3", "9"
		if got.Msg.UUID != uuid || !maps.Equal(map[string]string(got.Msg.Metadata), want) {
			t.Fatalf("wrote %q %v, the relay read %q %v (stored as %s)", uuid, msg.Metadata, got.Msg.UUID, got.Msg.Metadata, batch[0].metadata)
		}
	})
}
