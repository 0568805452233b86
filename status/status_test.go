package status_test

import (
	"context"
	"encoding/json"
	"net/url"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/status"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// seeded is a schema with something in every part of the report, written through the packages
// that own the tables, except the relay's bookkeeping (leases, registrations, call attempts and
// results), which only a running relay writes and is set here by hand.
type seeded struct {
	env      *txtest.Env
	messages []string
	callKey  string
}

func seed(t *testing.T) *seeded {
	t.Helper()
	ctx := context.Background()
	env := txtest.New(t)
	s := &seeded{env: env}
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := env.Pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}

	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	tx, err := env.Pool.Begin(ctx)
	require.NoError(t, err)
	for _, key := range []string{"order-1", "order-2"} {
		m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		outbox.SetPartitionKey(m, key)
		require.NoError(t, w.Publish(ctx, tx, "orders", m))
		s.messages = append(s.messages, m.UUID)
	}
	s.callKey, err = w.Call(outbox.ContextWithSource(ctx, outbox.Source{Consumer: "billing", DedupKey: "m-1"}), tx,
		outbox.Call{Name: "charge", Path: "/v1/charges", Params: url.Values{"amount": {"100"}}})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	// The relay tried the call once and failed; it declined another one earlier.
	exec("UPDATE " + env.Q("txbox_outbox") + " SET attempts = 1, first_attempt_at = now() - interval '1 minute', " +
		"next_attempt_at = now() + interval '1 minute', last_error = 'HTTP 503 api_error' WHERE kind = 'call'")
	exec("INSERT INTO " + env.Q("txbox_call_result") + " (idempotency_key, call_uuid, outcome, http_status, object_id, attempts, duration_ms) " +
		"VALUES ('k-declined', 'c-1', 'declined', 402, 'ch_1', 1, 120), ('k-ok', 'c-2', 'succeeded', 200, 'ch_2', 1, 80)")

	// A four-shard layout (three lease rows made so far): relay-a holds shard 0, relay-b's lease of
	// shard 1 expired, shard 2 was released (a relay leaves -infinity behind); relay-b's
	// registration expired.
	exec("INSERT INTO " + env.Q("txbox_lease") + " (shard, shards, owner, token, expires_at) VALUES " +
		"(0, 4, 'relay-a', 7, now() + interval '10 seconds'), (1, 4, 'relay-b', 5, now() - interval '1 minute'), " +
		"(2, 4, NULL, 3, '-infinity')")
	exec("INSERT INTO " + env.Q("txbox_relay_node") + " (owner, expires_at) VALUES " +
		"('relay-a', now() + interval '10 seconds'), ('relay-b', now() - interval '1 minute')")

	dead, err := dlq.NewWriter(env.Schema)
	require.NoError(t, err)
	tx, err = env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, dead.Add(ctx, tx, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing",
		DedupKey: "m-9", UUID: "m-9", Reason: "unprocessable", Error: "bad currency"}))
	require.NoError(t, dead.Add(ctx, tx, dlq.Entry{Source: dlq.SourceRelay, Kind: "call", Topic: "", UUID: "c-3",
		IdempotencyKey: "k-dead", Reason: relay.ReasonIdempotencyMismatch, Error: "HTTP 400 idempotency_error", Attempts: 1}))
	require.NoError(t, tx.Commit(ctx))

	// Four deliveries, one of them a duplicate.
	ib, err := inbox.New(inbox.Config{DB: env.Pool, Consumer: "billing", Schema: env.Schema, StatsInterval: time.Hour}, nil)
	require.NoError(t, err)
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	for _, id := range []string{"a", "b", "c", "a"} {
		_, err := h(message.NewMessage(id, nil))
		require.NoError(t, err)
	}
	require.NoError(t, ib.Flush(ctx))
	return s
}

func TestReadReportsEveryPart(t *testing.T) {
	t.Parallel()
	s := seed(t)
	rep, err := status.Read(context.Background(), s.env.Pool, status.Options{Schema: s.env.Schema, Window: time.Hour})
	require.NoError(t, err)

	require.WithinDuration(t, time.Now(), rep.At, time.Minute)
	require.Equal(t, s.env.Schema, rep.Schema)
	require.Equal(t, 3600.0, rep.WindowSeconds)

	require.Equal(t, int64(3), rep.Outbox.Pending)
	require.Len(t, rep.Outbox.Shards, 4, "every shard of the four-shard layout")
	var messages, calls, failing int64
	for i, sh := range rep.Outbox.Shards {
		require.Equal(t, i, sh.Shard)
		messages += sh.Messages
		calls += sh.Calls
		failing += sh.Failing
		if sh.Shard == 0 {
			require.Equal(t, "relay-a", sh.Owner, "the live lease's holder publishes shard 0")
		} else {
			require.Empty(t, sh.Owner, "no live lease on shard %d", sh.Shard)
		}
	}
	require.Equal(t, int64(2), messages)
	require.Equal(t, int64(1), calls)
	require.Equal(t, int64(1), failing, "the call whose attempt failed")

	require.Len(t, rep.Leases, 3)
	require.NotNil(t, rep.Leases[0].ExpiresAt)
	require.Equal(t, relay.Lease{Shard: 0, Shards: 4, Owner: "relay-a", Token: 7, ExpiresAt: rep.Leases[0].ExpiresAt}, rep.Leases[0])
	require.True(t, rep.Leases[0].ExpiresAt.After(rep.At))
	require.True(t, rep.Leases[1].Expired)
	require.Equal(t, "relay-b", rep.Leases[1].Owner)
	require.Nil(t, rep.Leases[2].ExpiresAt, "a released lease has no expiry")
	require.True(t, rep.Leases[2].Expired)
	require.Len(t, rep.Relays, 2)
	require.Equal(t, "relay-a", rep.Relays[0].Owner)
	require.True(t, rep.Relays[0].Live)
	require.False(t, rep.Relays[1].Live)

	require.Len(t, rep.DeadLetters, 2)
	for _, d := range rep.DeadLetters {
		require.Equal(t, int64(1), d.Count, d.Source)
	}

	require.Len(t, rep.Dedup, 1)
	d := rep.Dedup[0]
	require.Equal(t, "billing", d.Consumer)
	require.Equal(t, int64(4), d.Checks)
	require.Equal(t, int64(1), d.Hits)
	require.InDelta(t, 0.25, d.HitRate, 1e-9)
	require.GreaterOrEqual(t, d.AgeSeconds, 0.0)

	require.Len(t, rep.Calls.Failing, 1)
	require.Equal(t, s.callKey, rep.Calls.Failing[0].IdempotencyKey)
	require.NotNil(t, rep.Calls.Failing[0].NextAttemptAt)
	require.Equal(t, 1, rep.Calls.Failing[0].Attempts)
	require.Equal(t, "HTTP 503 api_error", rep.Calls.Failing[0].LastError)
	require.Len(t, rep.Calls.Unsuccessful, 1, "the succeeded call is not a failure")
	require.Equal(t, "k-declined", rep.Calls.Unsuccessful[0].IdempotencyKey)
	require.Equal(t, "declined", rep.Calls.Unsuccessful[0].Outcome)
	require.Len(t, rep.Calls.DeadLetters, 1, "call letters only")
	require.Equal(t, "k-dead", rep.Calls.DeadLetters[0].IdempotencyKey)

	tables := map[string]bool{}
	for _, tb := range rep.Tables {
		tables[tb.Table] = true
		require.Positive(t, tb.TotalBytes)
	}
	require.True(t, tables["txbox_outbox"])
	require.True(t, tables["txbox_dlq"])

	ages := map[string]status.Figure{}
	for _, f := range rep.Freshness {
		ages[f.Figure] = f
	}
	require.Equal(t, d.AgeSeconds, ages["dedup"].AgeSeconds)
	for _, f := range []string{"outbox", "leases", "relays", "dead_letters", "calls", "tables"} {
		require.Contains(t, ages, f)
	}
}

// The window bounds the dedup counts and the recent call results; a stale lease is still shown.
func TestReadWindow(t *testing.T) {
	t.Parallel()
	s := seed(t)
	_, err := s.env.Pool.Exec(context.Background(), "UPDATE "+s.env.Q("txbox_call_result")+" SET completed_at = now() - interval '2 hours'")
	require.NoError(t, err)
	rep, err := status.Read(context.Background(), s.env.Pool, status.Options{Schema: s.env.Schema, Window: time.Hour})
	require.NoError(t, err)
	require.Empty(t, rep.Calls.Unsuccessful)
	require.Len(t, rep.Leases, 3)
}

// The JSON form has the documented keys.
func TestReportJSON(t *testing.T) {
	t.Parallel()
	s := seed(t)
	rep, err := status.Read(context.Background(), s.env.Pool, status.Options{Schema: s.env.Schema})
	require.NoError(t, err)
	raw, err := json.Marshal(rep)
	require.NoError(t, err)
	var generic map[string]any
	require.NoError(t, json.Unmarshal(raw, &generic))
	for _, k := range []string{"at", "schema", "window_seconds", "outbox", "leases", "relays", "dead_letters", "dedup", "calls", "tables", "freshness"} {
		require.Contains(t, generic, k)
	}
	dedup := generic["dedup"].([]any)[0].(map[string]any)
	for _, k := range []string{"consumer", "handler", "checks", "hits", "hit_rate", "since", "updated", "age_seconds"} {
		require.Contains(t, dedup, k)
	}
	lease := generic["leases"].([]any)[0].(map[string]any)
	for _, k := range []string{"shard", "owner", "token", "expires_at", "expired"} {
		require.Contains(t, lease, k)
	}
	var back status.Report
	require.NoError(t, json.Unmarshal(raw, &back))
	require.True(t, rep.At.Equal(back.At))
}

func TestOptionsAreValidated(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	for _, o := range []status.Options{{Schema: "Bad-Name"}, {Window: -time.Second}, {Limit: -1}} {
		_, err := status.Read(context.Background(), env.Pool, o)
		require.Error(t, err, "%+v", o)
		require.Contains(t, err.Error(), "status: Options.")
	}
}
