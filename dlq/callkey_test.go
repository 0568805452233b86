package dlq_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
)

// CallFirstSent is the first sending of the earliest call letter with the key that was sent: a
// letter with no attempts was never sent and counts for nothing, nor do letters of other keys or
// message letters. It reads the letters of its key through an index, not the table: the relay asks
// before every call it sends, and the table may hold a million letters.
func TestCallFirstSentIsTheKeysEarliestSentLetter(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	const key = "pay-1"
	call := func(key string, attempts int) dlq.Entry {
		return dlq.Entry{Source: dlq.SourceRelay, Kind: "call", UUID: key, IdempotencyKey: key, Reason: "r", Attempts: attempts}
	}
	tb.addMany(t, 20_000, dlq.SourceRelay, "orders", "m")
	_, err := tb.env.Pool.Exec(ctx, `UPDATE `+tb.env.Q("txbox_dlq")+` SET kind = 'call', idempotency_key = uuid, attempts = 1`)
	require.NoError(t, err)
	_, err = tb.env.Pool.Exec(ctx, "ANALYZE "+tb.env.Q("txbox_dlq"))
	require.NoError(t, err)

	firstSent := func() (time.Time, bool) {
		var first time.Time
		var ok bool
		require.NoError(t, pgx.BeginFunc(ctx, tb.env.Pool, func(tx pgx.Tx) error {
			// The backend's counts not yet reported include its earlier statements': compare.
			seqScans := func() (n int64) {
				require.NoError(t, tx.QueryRow(ctx, `SELECT seq_scan FROM pg_stat_xact_user_tables
					WHERE relid = $1::regclass`, tb.env.Q("txbox_dlq")).Scan(&n))
				return n
			}
			before := seqScans()
			var err error
			if first, ok, err = tb.writer.CallFirstSent(ctx, tx, key); err != nil {
				return err
			}
			require.Equal(t, before, seqScans(), "the lookup read the whole dead-letter table")
			return nil
		}))
		return first, ok
	}

	_, ok := firstSent()
	require.False(t, ok, "no letter of the key")
	tb.age(t, tb.add(t, call(key, 0)), 50*time.Hour)
	tb.add(t, dlq.Entry{Source: dlq.SourceRelay, UUID: "reply", IdempotencyKey: key, Attempts: 3}) // a message letter
	_, ok = firstSent()
	require.False(t, ok, "a call never sent started nothing")

	tb.age(t, tb.add(t, call(key, 2)), 30*time.Hour)
	tb.age(t, tb.add(t, call(key, 1)), 10*time.Hour)
	first, ok := firstSent()
	require.True(t, ok)
	require.WithinDuration(t, time.Now().Add(-30*time.Hour), first, time.Minute, "the earliest sent letter's")
}
