package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// pending writes one committed outbox message and returns its row id.
func (b *cliBundle) pending(t *testing.T, topic, key string, payload []byte) int64 {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.New(outbox.Config{Schema: b.env.Schema})
	require.NoError(t, err)
	msg := outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), payload), key)
	require.NoError(t, w.Publish(ctx, b.env.Pool, topic, msg))
	var id int64
	require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT max(id) FROM `+b.env.Q("txbox_outbox")).Scan(&id))
	return id
}

func TestOutboxListShowBury(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	stuck := b.pending(t, "retired.topic", "order-7", []byte("evil \x1b[2J payload"))
	other := b.pending(t, "orders", "order-8", []byte(`{"order":8}`))
	shardOf := relay.ShardOf("order-7", "", relay.DefaultShards)

	out := b.ok(t, "outbox", "list")
	busy := "2 of 16"
	if relay.ShardOf("order-8", "", relay.DefaultShards) == shardOf {
		busy = "1 of 16"
	}
	require.Contains(t, out, "2 pending row(s) in "+busy+" shard(s)", "the shards with pending rows, of all")
	require.Contains(t, out, "retired.topic")
	require.Contains(t, out, "2 row(s)")

	// One partition key of a megabyte does not widen every row of the table; show prints it whole.
	long := b.pending(t, "orders", strings.Repeat("k", 1<<20), nil)
	out = b.ok(t, "outbox", "list")
	require.Less(t, len(out), 10_000, "the table is as wide as its longest key")
	require.Contains(t, out, strings.Repeat("k", 59)+"…")
	require.Contains(t, b.ok(t, "outbox", "show", fmt.Sprint(long)), strings.Repeat("k", 1<<20))
	_, err := b.env.Pool.Exec(context.Background(), "DELETE FROM "+b.env.Q("txbox_outbox")+" WHERE id = $1", long)
	require.NoError(t, err)

	var listed struct {
		Shards []shardJSON `json:"shards"`
		Rows   []rowJSON   `json:"rows"`
	}
	require.NoError(t, json.Unmarshal([]byte(b.ok(t, "outbox", "list", "--json", "--topic", "retired.topic")), &listed))
	require.Len(t, listed.Shards, relay.DefaultShards)
	require.Len(t, listed.Rows, 1)
	require.Equal(t, stuck, listed.Rows[0].ID)
	require.Equal(t, shardOf, listed.Rows[0].Shard)
	require.Nil(t, listed.Rows[0].Payload, "list leaves payloads out")

	require.NoError(t, json.Unmarshal([]byte(b.ok(t, "outbox", "list", "--json", "--shard", fmt.Sprint(shardOf), "--key", "order-7")), &listed))
	require.Len(t, listed.Rows, 1)

	out = b.ok(t, "outbox", "show", fmt.Sprint(stuck))
	require.Contains(t, out, `evil \x1b[2J payload`, "stored text is escaped for the terminal")
	require.NotContains(t, out, "\x1b")
	var shown rowJSON
	require.NoError(t, json.Unmarshal([]byte(b.ok(t, "outbox", "show", fmt.Sprint(stuck), "--json")), &shown))
	require.Equal(t, "evil \x1b[2J payload", *shown.Payload, "--json is exact")

	out = b.ok(t, "outbox", "bury", fmt.Sprint(stuck), "--reason", "topic retired, see OPS-12")
	require.Contains(t, out, fmt.Sprintf("buried outbox row %d", stuck))
	require.Equal(t, 1, b.count(t, "txbox_outbox"), "only the buried row left the outbox")
	var letters []letterJSON
	require.NoError(t, json.Unmarshal([]byte(b.ok(t, "dlq", "list", "--json", "--source", "relay")), &letters))
	require.Len(t, letters, 1)
	require.Equal(t, relay.ReasonBuried, letters[0].Reason)
	require.Contains(t, letters[0].Error, "topic retired, see OPS-12")
	require.Equal(t, "order-7", letters[0].PartitionKey)

	require.Contains(t, b.fails(t, 1, "outbox", "bury", fmt.Sprint(stuck), "--reason", "again"), "no such pending outbox row")
	require.Contains(t, b.fails(t, 1, "outbox", "show", fmt.Sprint(stuck)), "no such pending outbox row")
	b.ok(t, "outbox", "show", fmt.Sprint(other))

	// A call that was attempted may be at the provider as it is buried: bury says what follows.
	ctx := context.Background()
	w, err := outbox.New(outbox.Config{Schema: b.env.Schema})
	require.NoError(t, err)
	_, err = w.Call(ctx, b.env.Pool, outbox.Call{IdempotencyKey: "order-9-charge", Name: "charge", Path: "/v1/charges",
		Params: url.Values{"amount": {"100"}, "currency": {"eur"}}})
	require.NoError(t, err)
	var call int64
	require.NoError(t, b.env.Pool.QueryRow(ctx, `UPDATE `+b.env.Q("txbox_outbox")+` SET attempts = 1, first_attempt_at = now()
		WHERE kind = 'call' RETURNING id`).Scan(&call))
	out = b.ok(t, "outbox", "bury", fmt.Sprint(call), "--reason", "stuck")
	require.Contains(t, out, "the call was attempted 1 time(s): if a request is at the provider now, the relay stores and replies its answer")
}
