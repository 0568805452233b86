package inbox_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/pgtext"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

// FuzzInboxContainsAnyMessage: whatever a message carries — any UUID, payload, lease metadata or
// other metadata — the inbox never panics and never leaves it to be redelivered forever: each
// delivery is acknowledged, and a message not seen before is either processed once or
// dead-lettered, never dropped in silence; one seen before changes nothing.
func FuzzInboxContainsAnyMessage(f *testing.F) {
	env := txtest.New(f)
	ctx := context.Background()
	if _, err := env.Pool.Exec(ctx, "CREATE TABLE "+env.Q("effects")+" (id bytea NOT NULL)"); err != nil {
		f.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{DB: env.Pool, Consumer: "fuzz", Schema: env.Schema, MaxAttempts: 3, MaxPayloadBytes: 64}, nil)
	if err != nil {
		f.Fatal(err)
	}
	handled := 0
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		handled++
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "INSERT INTO "+env.Q("effects")+" VALUES ($1)", []byte(msg.UUID))
		return nil, err
	})
	// state counts what the inbox settled so far: effects applied, inbox rows, dead letters.
	state := func(t *testing.T) (effects, settled, dead int) {
		t.Helper()
		err := env.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+env.Q("effects")+"), (SELECT count(*) FROM "+env.Q("txbox_inbox")+
			"), (SELECT count(*) FROM "+env.Q("txbox_dlq")+")").Scan(&effects, &settled, &dead)
		if err != nil {
			t.Fatal(err)
		}
		return effects, settled, dead
	}
	// Each fuzzing process has a schema of its own, so what it delivered before is what its
	// inbox has seen. The default dedup key is the UUID; a message without a usable one is known
	// by everything it carries.
	seen := map[string]bool{}
	identity := func(msg *message.Message) string {
		if msg.UUID != "" && pgtext.Valid(msg.UUID) {
			return "uuid " + msg.UUID
		}
		id := fmt.Sprintf("content %q %q", msg.UUID, msg.Payload)
		for _, k := range slices.Sorted(maps.Keys(msg.Metadata)) {
			id += fmt.Sprintf(" %q=%q", k, msg.Metadata[k])
		}
		return id
	}

	f.Add("8f14e45f-ceea-467a-9575-7f1c3d9a1e2b", []byte(`{"amount":100}`), "3", "42", "txbox_partition_key", "order-7")
	f.Add("", []byte("{}"), "", "", "", "")
	f.Add("", []byte("{}!"), "", "", "", "")
	f.Add("too-large", make([]byte, 65), "", "", "a", "b")
	f.Add("bad-shard", []byte("x"), "not-a-number", "7", "", "")
	f.Add("shard-only", []byte("x"), "1", "", "", "")
	f.Add("token-only", []byte("x"), "", "1", "", "")
	f.Add("overflow", []byte("x"), "2147483648", "9223372036854775808", "", "")
	f.Add("signs", []byte("x"), "+1", "-5", "", "")
	f.Add("unicode-é", []byte("\xff\x00"), "0", "0", "ключ", "значение")
	f.Add("reserved", []byte("x"), "", "", "_watermill_message_uuid", "other")
	f.Fuzz(func(t *testing.T, uuid string, payload []byte, shard, token, key, value string) {
		msg := message.NewMessage(uuid, payload)
		if shard != "" {
			msg.Metadata.Set(outbox.ShardMetadata, shard)
		}
		if token != "" {
			msg.Metadata.Set(outbox.TokenMetadata, token)
		}
		msg.Metadata.Set(key, value)

		id := identity(msg)
		effects, settled, dead := state(t)
		calls := handled
		if err := deliver(h, msg); err != nil {
			t.Fatalf("delivery of %q failed, so it would be redelivered forever: %v", uuid, err)
		}
		effects2, settled2, dead2 := state(t)
		ran := handled - calls
		switch {
		case seen[id] && ran == 0 && effects2 == effects && settled2 == settled && dead2 == dead:
			// A redelivery of a settled message: nothing happens.
		case !seen[id] && ran == 1 && effects2 == effects+1 && settled2 == settled+1 && dead2 == dead:
			// Processed, once.
		case !seen[id] && ran == 0 && effects2 == effects && settled2 == settled+1 && dead2 == dead+1:
			// Dead-lettered.
		default:
			t.Fatalf("%q (seen before: %v): handler ran %d times, %+d effects, %+d inbox rows, %+d dead letters; want processed once, dead-lettered, or nothing for a redelivery",
				uuid, seen[id], ran, effects2-effects, settled2-settled, dead2-dead)
		}
		seen[id] = true
	})
}
