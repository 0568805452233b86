package dlq_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/txtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type testBundle struct {
	env    *txtest.Env
	admin  *dlq.Admin
	writer *dlq.Writer
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	env := txtest.New(t)
	admin, err := dlq.NewAdmin(dlq.AdminConfig{Schema: env.Schema})
	require.NoError(t, err)
	writer, err := dlq.NewWriter(env.Schema)
	require.NoError(t, err)
	return &testBundle{env: env, admin: admin, writer: writer}
}

// add writes e as txbox's components do and returns its id.
func (tb *testBundle) add(t *testing.T, e dlq.Entry) int64 {
	t.Helper()
	ctx := context.Background()
	if e.Source == "" {
		e.Source = dlq.SourceInbox
	}
	if e.Topic == "" {
		e.Topic = "orders"
	}
	if e.Reason == "" {
		e.Reason = "attempts exhausted"
	}
	if e.Source == dlq.SourceInbox && e.Consumer == "" {
		e.Consumer = "billing"
	}
	if e.Source == dlq.SourceInbox && e.DedupKey == "" {
		e.DedupKey = e.UUID
	}
	require.NoError(t, tb.writer.Add(ctx, tb.env.Pool, e))
	var id int64
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT max(id) FROM `+tb.env.Q("txbox_dlq")+` WHERE uuid = $1`, e.UUID).Scan(&id))
	return id
}

// age makes a letter look as if it first failed ago.
func (tb *testBundle) age(t *testing.T, id int64, ago time.Duration) {
	t.Helper()
	_, err := tb.env.Pool.Exec(context.Background(),
		`UPDATE `+tb.env.Q("txbox_dlq")+` SET first_failed_at = now() - $2 * interval '1 second' WHERE id = $1`, id, ago.Seconds())
	require.NoError(t, err)
}

// addMany inserts n message letters for topic straight into the table, uuids prefix-1 … prefix-n.
func (tb *testBundle) addMany(t *testing.T, n int, source dlq.Source, topic, prefix string) {
	t.Helper()
	consumer := ""
	if source == dlq.SourceInbox {
		consumer = "billing"
	}
	_, err := tb.env.Pool.Exec(context.Background(), `
		INSERT INTO `+tb.env.Q("txbox_dlq")+` (source, topic, consumer, dedup_key, partition_key, uuid, payload, reason)
		SELECT $1, $2, $3, CASE WHEN $3 = '' THEN '' ELSE $4 || g END, 'key-' || (g % 7), $4 || g, convert_to('payload ' || g, 'UTF8'), 'attempts exhausted'
		FROM generate_series(1, $5) AS g`, string(source), topic, consumer, prefix+"-", n)
	require.NoError(t, err)
}

func ids(letters []dlq.Letter) []int64 {
	out := make([]int64, len(letters))
	for i, l := range letters {
		out[i] = l.ID
	}
	return out
}

func TestListFilters(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()

	a := tb.add(t, dlq.Entry{UUID: "a", Consumer: "billing", Reason: "attempts exhausted", Payload: []byte(`{"n":1}`),
		Metadata: map[string]string{"txbox_partition_key": "k1", "trace": "t"}, PartitionKey: "k1", Error: "boom", Attempts: 10})
	b := tb.add(t, dlq.Entry{UUID: "b", Consumer: "shipping", Reason: "Payload Too Large"})
	c := tb.add(t, dlq.Entry{UUID: "c", Source: dlq.SourceRelay, Topic: "invoices", Reason: "rejected by broker"})
	d := tb.add(t, dlq.Entry{UUID: "d", Source: dlq.SourceRelay, Kind: "call", Topic: "charges.replies", IdempotencyKey: "idem-d", Reason: "key expired"})
	tb.age(t, a, 3*time.Hour)
	tb.age(t, b, 90*time.Minute)

	for _, tc := range []struct {
		name string
		f    dlq.Filter
		want []int64
	}{
		{"no filter", dlq.Filter{}, []int64{a, b, c, d}},
		{"source inbox", dlq.Filter{Source: dlq.SourceInbox}, []int64{a, b}},
		{"source relay", dlq.Filter{Source: dlq.SourceRelay}, []int64{c, d}},
		{"kind call", dlq.Filter{Kind: "call"}, []int64{d}},
		{"topic", dlq.Filter{Topic: "invoices"}, []int64{c}},
		{"consumer", dlq.Filter{Consumer: "shipping"}, []int64{b}},
		{"reason substring ignoring case", dlq.Filter{Reason: "too LARGE"}, []int64{b}},
		{"reason with LIKE wildcards is literal", dlq.Filter{Reason: "%"}, nil},
		{"older than", dlq.Filter{OlderThan: time.Hour}, []int64{a, b}},
		{"younger than", dlq.Filter{YoungerThan: 2 * time.Hour}, []int64{b, c, d}},
		{"age window", dlq.Filter{OlderThan: time.Hour, YoungerThan: 2 * time.Hour}, []int64{b}},
		{"ids", dlq.Filter{IDs: []int64{d, a, 999999}}, []int64{a, d}},
		{"limit keeps the lowest ids", dlq.Filter{Limit: 2}, []int64{a, b}},
		{"conditions combine", dlq.Filter{Source: dlq.SourceRelay, Reason: "broker"}, []int64{c}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tb.admin.List(ctx, tb.env.Pool, tc.f)
			require.NoError(t, err)
			if tc.want == nil {
				require.Empty(t, got)
			} else {
				require.Equal(t, tc.want, ids(got))
			}
			n, err := tb.admin.Count(ctx, tb.env.Pool, tc.f)
			require.NoError(t, err)
			require.Equal(t, len(tc.want), n)
		})
	}

	got, err := tb.admin.Get(ctx, tb.env.Pool, a)
	require.NoError(t, err)
	require.Equal(t, dlq.SourceInbox, got.Source)
	require.Equal(t, "message", got.Kind)
	require.Equal(t, "orders", got.Topic)
	require.Equal(t, "billing", got.Consumer)
	require.Equal(t, "a", got.DedupKey)
	require.Equal(t, "k1", got.PartitionKey)
	require.Equal(t, []byte(`{"n":1}`), got.Payload)
	require.Equal(t, map[string]string{"txbox_partition_key": "k1", "trace": "t"}, got.Metadata)
	require.Equal(t, "boom", got.Error)
	require.Equal(t, 10, got.Attempts)
	require.WithinDuration(t, time.Now().Add(-3*time.Hour), got.FirstFailedAt, time.Minute)

	call, err := tb.admin.Get(ctx, tb.env.Pool, d)
	require.NoError(t, err)
	require.Equal(t, "idem-d", call.IdempotencyKey)

	_, err = tb.admin.Get(ctx, tb.env.Pool, 999999)
	require.ErrorIs(t, err, dlq.ErrNotFound)
}

func TestFilterValidation(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	for _, f := range []dlq.Filter{
		{Source: "kafka"}, {Kind: "email"}, {OlderThan: -time.Second}, {YoungerThan: -time.Second}, {Limit: -1},
	} {
		_, err := tb.admin.List(ctx, tb.env.Pool, f)
		require.Error(t, err, "%+v", f)
		_, err = tb.admin.Discard(ctx, tb.env.Pool, f)
		require.Error(t, err, "%+v", f)
	}
	_, err := dlq.NewAdmin(dlq.AdminConfig{Schema: "Bad-Name"})
	require.ErrorContains(t, err, "AdminConfig.Schema")
}

func TestDiscard(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	for i := range 5 {
		tb.add(t, dlq.Entry{UUID: fmt.Sprint("s", i), Consumer: "shipping"})
	}
	b := tb.add(t, dlq.Entry{UUID: "b1", Consumer: "billing"})
	tb.add(t, dlq.Entry{UUID: "b2", Consumer: "billing"})
	// The inbox marks a message dead when it writes its letter.
	_, err := tb.env.Pool.Exec(ctx, `INSERT INTO `+tb.env.Q("txbox_inbox")+` (consumer, dedup_key, message_uuid, topic, state)
		VALUES ('billing', 'b1', 'b1', 'orders', 'dead')`)
	require.NoError(t, err)

	_, err = tb.admin.Discard(ctx, tb.env.Pool, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrEmptyFilter)
	_, err = tb.admin.Discard(ctx, tb.env.Pool, dlq.Filter{Limit: 3})
	require.ErrorIs(t, err, dlq.ErrEmptyFilter, "a limit alone selects nothing in particular")

	n, err := tb.admin.Discard(ctx, tb.env.Pool, dlq.Filter{Consumer: "shipping", Limit: 2})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	n, err = tb.admin.Discard(ctx, tb.env.Pool, dlq.Filter{IDs: []int64{b, 999999}})
	require.NoError(t, err)
	require.Equal(t, 1, n)

	left, err := tb.admin.Count(ctx, tb.env.Pool, dlq.Filter{})
	require.NoError(t, err)
	require.Equal(t, 4, left)

	var state string
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT state FROM `+tb.env.Q("txbox_inbox")+` WHERE dedup_key = 'b1'`).Scan(&state))
	require.Equal(t, "dead", state, "a discarded letter's message must still be skipped when the broker redelivers it")

	n, err = tb.admin.Discard(ctx, tb.env.Pool, dlq.Filter{All: true})
	require.NoError(t, err)
	require.Equal(t, 4, n)
}
