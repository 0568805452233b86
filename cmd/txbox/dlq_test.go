package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/txtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type cliBundle struct {
	*cliEnv
	env    *txtest.Env
	writer *dlq.Writer
}

func setupCLI(t *testing.T) *cliBundle {
	t.Helper()
	e := newCLIEnv(t)
	w, err := dlq.NewWriter(e.Schema)
	require.NoError(t, err)
	return &cliBundle{cliEnv: e, env: e.Env, writer: w}
}

// ok runs txbox and requires it to succeed, returning its standard output.
func (b *cliBundle) ok(t *testing.T, args ...string) string {
	t.Helper()
	r := b.txbox(t, nil, args...)
	require.Zero(t, r.code, "%v\n%s", args, r)
	return r.stdout
}

// fails runs txbox and requires it to exit with code, returning its standard error.
func (b *cliBundle) fails(t *testing.T, code int, args ...string) string {
	t.Helper()
	r := b.txbox(t, nil, args...)
	require.Equal(t, code, r.code, "%v\n%s", args, r)
	return r.stderr
}

func (b *cliBundle) add(t *testing.T, e dlq.Entry) int64 {
	t.Helper()
	ctx := context.Background()
	if e.Topic == "" {
		e.Topic = "orders"
	}
	if e.Reason == "" {
		e.Reason = "attempts exhausted"
	}
	require.NoError(t, b.writer.Add(ctx, b.env.Pool, e))
	var id int64
	require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT max(id) FROM `+b.env.Q("txbox_dlq")).Scan(&id))
	return id
}

func (b *cliBundle) addMany(t *testing.T, n int, kind string) {
	t.Helper()
	_, err := b.env.Pool.Exec(context.Background(), `
		INSERT INTO `+b.env.Q("txbox_dlq")+` (source, kind, topic, uuid, payload, reason, idempotency_key)
		SELECT 'relay', $2, 'bulk', 'bulk-' || g, '', 'rejected by broker', CASE WHEN $2 = 'call' THEN 'idem-' || g END
		FROM generate_series(1, $1) AS g`, n, kind)
	require.NoError(t, err)
}

func (b *cliBundle) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+b.env.Q(table)).Scan(&n))
	return n
}

func TestDLQList(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	a := b.add(t, dlq.Entry{Source: dlq.SourceInbox, Consumer: "billing", Handler: "charge", DedupKey: "m-a", UUID: "m-a", Reason: "attempts exhausted", Attempts: 10})
	r := b.add(t, dlq.Entry{Source: dlq.SourceRelay, Topic: "invoices", UUID: "m-r", Reason: "rejected by broker"})
	_, err := b.env.Pool.Exec(context.Background(), `UPDATE `+b.env.Q("txbox_dlq")+` SET first_failed_at = now() - interval '2 days' WHERE id = $1`, a)
	require.NoError(t, err)

	out := b.ok(t, "dlq", "list")
	require.Regexp(t, `(?m)^ID +SOURCE +KIND +TOPIC +CONSUMER +HANDLER +REASON`, out)
	require.Regexp(t, `billing +charge +attempts exhausted`, out, "two handlers' letters of one message are told apart")
	require.Contains(t, out, "m-a")
	require.Contains(t, out, "m-r")
	require.Contains(t, out, "2d0h")
	require.Contains(t, out, "2 letter(s)")

	for _, tc := range []struct {
		args []string
		want []int64
	}{
		{[]string{"--source", "inbox"}, []int64{a}},
		{[]string{"--consumer", "billing"}, []int64{a}},
		{[]string{"--handler", "charge"}, []int64{a}},
		{[]string{"--handler", "email"}, nil},
		{[]string{"--topic", "invoices"}, []int64{r}},
		{[]string{"--reason", "BROKER"}, []int64{r}},
		{[]string{"--older-than", "1d"}, []int64{a}},
		{[]string{"--younger-than", "1d12h"}, []int64{r}},
		{[]string{"--id", fmt.Sprint(r)}, []int64{r}},
		{[]string{"--id", fmt.Sprintf("%d,%d", a, r)}, []int64{a, r}},
		{[]string{"--id", fmt.Sprint(a), "--id", fmt.Sprint(r)}, []int64{a, r}},
		{[]string{"--kind", "call"}, nil},
	} {
		out := b.ok(t, append([]string{"dlq", "list", "--json"}, tc.args...)...)
		var got []struct {
			ID           int64  `json:"id"`
			Source       string `json:"source"`
			PayloadBytes int    `json:"payload_bytes"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &got), out)
		var ids []int64
		for _, l := range got {
			ids = append(ids, l.ID)
		}
		require.Equal(t, tc.want, ids, tc.args)
	}

	out = b.ok(t, "dlq", "list", "--limit", "1")
	require.Contains(t, out, "1 of 2 letters (raise --limit to see more)")
}

func TestDLQShow(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	id := b.add(t, dlq.Entry{Source: dlq.SourceInbox, Consumer: "billing", Handler: "charge", DedupKey: "k-1", UUID: "m-1", PartitionKey: "order-7",
		Payload: []byte(`{"order":7}`), Metadata: map[string]string{"b": "2", "a": "1"}, Error: "line one\nline two"})
	bin := b.add(t, dlq.Entry{Source: dlq.SourceRelay, Kind: "call", UUID: "c-1", IdempotencyKey: "idem-1", Payload: []byte{0xff, 0x00}})

	out := b.ok(t, "dlq", "show", fmt.Sprint(id))
	for _, want := range []string{"uuid:", "m-1", "consumer:", "billing", "handler:", "charge", "order-7", "  line one\n  line two", "  a: 1\n  b: 2", `payload (11 bytes):`, `  {"order":7}`} {
		require.Contains(t, out, want)
	}

	out = b.ok(t, "dlq", "show", fmt.Sprint(bin), "--json")
	var got map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &got))
	require.Equal(t, "/wA=", got["payload_base64"])
	require.Equal(t, "idem-1", got["idempotency_key"])
	require.NotContains(t, got, "payload")

	out = b.ok(t, "dlq", "show", fmt.Sprint(bin))
	require.Contains(t, out, "cannot be redriven")

	require.Contains(t, b.fails(t, 1, "dlq", "show", "999999"), "no such letter")
}

func TestDLQDiscard(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	a := b.add(t, dlq.Entry{Source: dlq.SourceInbox, Consumer: "billing", DedupKey: "m-a", UUID: "m-a"})
	b.add(t, dlq.Entry{Source: dlq.SourceInbox, Consumer: "shipping", DedupKey: "m-b", UUID: "m-b"})
	b.addMany(t, 3, "message")

	b.fails(t, 2, "dlq", "discard", "--limit", "2")

	out := b.ok(t, "dlq", "discard", "--source", "relay", "--dry-run")
	require.Equal(t, "dry run: 3 letter(s) would be discarded; nothing was deleted\n", out)
	require.Equal(t, 5, b.count(t, "txbox_dlq"))

	out = b.ok(t, "dlq", "discard", "--id", fmt.Sprintf("%d,999999", a))
	require.Equal(t, "discarded 1 letter(s) (1 of the given ids did not match)\n", out)

	out = b.ok(t, "dlq", "discard", "--source", "relay")
	require.Equal(t, "discarded 3 letter(s)\n", out)

	out = b.ok(t, "dlq", "discard", "--all")
	require.Equal(t, "discarded 1 letter(s)\n", out)
	require.Zero(t, b.count(t, "txbox_dlq"))
}

func TestDLQRedrive(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	b.addMany(t, 150, "message")
	inboxID := b.add(t, dlq.Entry{Source: dlq.SourceInbox, Consumer: "billing", DedupKey: "m-1", UUID: "m-1"})
	_, err := b.env.Pool.Exec(context.Background(), `INSERT INTO `+b.env.Q("txbox_inbox")+
		` (consumer, dedup_key, message_uuid, topic, state) VALUES ('billing', 'm-1', 'm-1', 'orders', 'dead')`)
	require.NoError(t, err)

	out := b.ok(t, "dlq", "redrive", "--source", "relay", "--dry-run")
	require.Contains(t, out, "dry run: 150 letter(s) would be redriven")
	require.Contains(t, out, "bulk")
	require.Contains(t, out, "… and 130 more")
	require.Contains(t, out, "a real run needs --rate")
	require.Contains(t, out, "nothing was moved")
	require.Zero(t, b.count(t, "txbox_outbox"))
	require.Equal(t, 151, b.count(t, "txbox_dlq"))

	stderr := b.fails(t, 2, "dlq", "redrive", "--source", "relay")
	require.Contains(t, stderr, "150 letters match; redriving more than 100 needs an explicit --rate / TXBOX_REDRIVE_RATE")
	require.Zero(t, b.count(t, "txbox_outbox"))

	// A hundred or fewer move without --rate.
	r := b.txbox(t, nil, "dlq", "redrive", "--id", fmt.Sprint(inboxID))
	require.Zero(t, r.code, r)
	out = r.stdout
	require.Regexp(t, `redrive starting" .*rate=unlimited `, r.stderr)
	require.Contains(t, out, "redrove 1 letter(s) into the outbox")
	require.Contains(t, out, "released 1 dead inbox row(s)")
	require.Equal(t, 1, b.count(t, "txbox_outbox"))
	require.Zero(t, b.count(t, "txbox_inbox"))

	r = b.txbox(t, nil, "dlq", "redrive", "--source", "relay", "--rate", "100", "--batch-size", "40")
	require.Zero(t, r.code, r)
	out = r.stdout
	require.Contains(t, out, "redrove 150 letter(s) into the outbox")
	require.Regexp(t, `redrive starting" .*rate=100 burst=10 batch_size=10`, r.stderr, "the start line shows the burst and batch the rate resolved to")
	require.Equal(t, 1, strings.Count(r.stderr, " burst="), r.stderr)
	require.Equal(t, 151, b.count(t, "txbox_outbox"))
	require.Zero(t, b.count(t, "txbox_dlq"))

	out = b.ok(t, "dlq", "redrive", "--all")
	require.Equal(t, "no letters match; nothing to redrive\n", out)
}

func TestDLQRedriveRefusesCalls(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	b.addMany(t, 2, "call")
	b.add(t, dlq.Entry{Source: dlq.SourceRelay, UUID: "m-1"})

	// A selection that holds calls is refused like any unusable flags (exit 2).
	for _, args := range [][]string{{"--all"}, {"--all", "--dry-run"}} {
		stderr := b.fails(t, 2, append([]string{"dlq", "redrive"}, args...)...)
		require.Contains(t, stderr, "reconcile them with the provider by hand, then discard them")
	}
	require.Zero(t, b.count(t, "txbox_outbox"))

	out := b.ok(t, "dlq", "redrive", "--kind", "message")
	require.Contains(t, out, "redrove 1 letter(s)")
}

func TestParseAge(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{
		"90m": 90 * time.Minute, "36h": 36 * time.Hour, "7d": 7 * 24 * time.Hour, "1d12h": 36 * time.Hour, "0": 0,
	} {
		got, err := parseAge(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "d", "xd", "1w", "-5m", "1d-48h", "-1d", "213506d", "106752d", "3651d", "87601h"} {
		_, err := parseAge(in)
		require.Error(t, err, in)
	}
	require.True(t, strings.HasPrefix(formatAge(49*time.Hour), "2d1h"))
}

func TestRetentionCommand(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	_, err := b.env.Pool.Exec(context.Background(), `INSERT INTO `+b.env.Q("txbox_inbox")+` (consumer, dedup_key, message_uuid, topic, received_at)
		SELECT 'billing', 'k-' || g, 'k-' || g, 'orders', now() - CASE WHEN g <= 30 THEN interval '9 days' ELSE interval '1 day' END
		FROM generate_series(1, 40) AS g`)
	require.NoError(t, err)

	require.Equal(t, 40, b.count(t, "txbox_inbox"))

	out := b.ok(t, "retention", "--broker-retention", "7d", "--inbox-retention", "8d", "--batch-size", "7")
	require.Contains(t, out, "inbox generation 0; dropped 0 old generation(s) whole")
	require.Contains(t, out, "deleted one by one 30 processed and 0 dead inbox row(s) of the current generation, 0 attempt counter(s), 0 call result(s)")
	require.Contains(t, out, "txbox_inbox")
	require.Contains(t, out, "DEAD ROWS")
	require.Equal(t, 10, b.count(t, "txbox_inbox"))
}
