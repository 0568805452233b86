package main

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/status"
)

func TestStatusCommand(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	ctx := context.Background()
	b.add(t, dlq.Entry{Source: dlq.SourceInbox, Consumer: "billing", DedupKey: "m-1", UUID: "m-1"})
	b.add(t, dlq.Entry{Source: dlq.SourceInbox, Consumer: "billing", DedupKey: "m-2", UUID: "m-2"})
	// Stored text that would rewrite an operator's terminal: a relay owner and a call's last error.
	const owner = "relay-\x1b[2J\u202eevil"
	const lastErr = "HTTP 503\x1b[31m red"
	_, err := b.env.Pool.Exec(ctx, "INSERT INTO "+b.env.Q("txbox_lease")+
		" (shard, shards, owner, token, expires_at) VALUES (0, 1, $1, 4, now() + interval '1 minute')", owner)
	require.NoError(t, err)
	w, err := outbox.New(outbox.Config{Schema: b.env.Schema})
	require.NoError(t, err)
	key, err := w.Call(ctx, b.env.Pool, outbox.Call{IdempotencyKey: "m-3-charge", Name: "charge", Path: "/v1/charges"})
	require.NoError(t, err)
	_, err = b.env.Pool.Exec(ctx, "UPDATE "+b.env.Q("txbox_outbox")+" SET attempts = 2, first_attempt_at = now(), last_error = $1", lastErr)
	require.NoError(t, err)

	out := b.ok(t, "status")
	require.Regexp(t, regexp.MustCompile(`(?m)^inbox +2 +\S`), out)
	require.Regexp(t, regexp.MustCompile(`(?m)^relay +0 +-$`), out)
	require.Regexp(t, regexp.MustCompile(`OUTBOX: 1 pending`), out)
	require.Regexp(t, regexp.MustCompile(`(?m)^0 +relay-\\x1b\[2J\\u202eevil +4 +in `), out, "the owner, escaped")
	require.Contains(t, out, `HTTP 503\x1b[31m red`, "the call's error, escaped")
	require.Contains(t, out, key)
	require.NotContains(t, out, "\x1b", "no raw escape reaches the terminal")
	require.NotContains(t, out, "\u202e")

	for _, section := range []string{"LEASES", "RELAYS", "DEAD LETTERS", "DEDUP (last 15m)", "CALLS FAILING", "TABLES", "FRESHNESS"} {
		require.Contains(t, out, section)
	}
	for _, table := range []string{"txbox_outbox", "txbox_inbox", "txbox_inbox_attempt", "txbox_dlq", "txbox_call_result"} {
		require.Contains(t, out, table)
	}

	// --json is the report, exact.
	raw := b.ok(t, "status", "--json", "--window", "2h")
	var rep status.Report
	dec := json.NewDecoder(strings.NewReader(raw))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&rep))
	require.Equal(t, b.env.Schema, rep.Schema)
	require.Equal(t, 7200.0, rep.WindowSeconds)
	require.Len(t, rep.Leases, 1)
	require.Equal(t, owner, rep.Leases[0].Owner)
	require.Len(t, rep.Calls.Failing, 1)
	require.Equal(t, lastErr, rep.Calls.Failing[0].LastError)
	require.Equal(t, key, rep.Calls.Failing[0].IdempotencyKey)
	require.Equal(t, int64(1), rep.Outbox.Pending)
	for _, d := range rep.DeadLetters {
		if d.Source == dlq.SourceInbox {
			require.Equal(t, int64(2), d.Count)
		}
	}

	_, err = b.env.Pool.Exec(ctx, "DELETE FROM "+b.env.Q("txbox_outbox"))
	require.NoError(t, err)
	require.Contains(t, b.ok(t, "status"), "OUTBOX: nothing pending", "no age of the oldest of nothing")
}

func TestStatusWindowIsValidated(t *testing.T) {
	t.Parallel()
	b := setupCLI(t)
	stderr := b.fails(t, 2, "status", "--window", "10s")
	require.Contains(t, stderr, "--window / TXBOX_STATUS_WINDOW")
}
