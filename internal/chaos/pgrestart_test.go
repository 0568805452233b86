package chaos_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/pgserver"
	"github.com/txbox/txbox/internal/txtest"
)

// PostgreSQL restarting under load — a clean restart, then a crash-like one — loses nothing and
// duplicates nothing: producers keep writing, the relay and the consumer lose their connections and
// leases, back off, reconnect and finish, and every committed message is applied exactly once, in
// key order. A throwaway server is used so the machine's shared one is never restarted.
func TestPostgresRestartUnderLoad(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	start, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	srv, err := pgserver.StartThrowaway(start, t.Logf)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, srv.Stop()) })
	// The throwaway is tuned for speed with synchronous_commit = off, which an immediate (crash)
	// restart punishes as it should: it loses commits already reported, including ones the relay
	// already published (phantom messages) and inbox commits already acknowledged to Kafka (lost
	// effects). txbox's guarantees assume the default, synchronous_commit = on. (fsync can stay off:
	// the operating system, which keeps the written WAL, does not crash here.)
	conn, err := pgx.Connect(ctx, srv.URL)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "ALTER SYSTEM SET synchronous_commit = on")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "SELECT pg_reload_conf()")
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))
	b := newBundle(t, txtest.NewIn(t, srv.URL))
	b.startRelay(t, b.env.Pool)
	b.startConsumer(t, "ledger")

	// Producers: one per key set, so each key's transactions run one after the other. A failed
	// transaction is not retried: whether its commit took effect is for the ledger to say.
	var (
		failures atomic.Int64
		written  atomic.Int64
		wg       sync.WaitGroup
	)
	stop := make(chan struct{})
	for p := range 2 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-time.After(5 * time.Millisecond):
				}
				key := fmt.Sprintf("key-%d", p*3+i%3)
				msgs := []*message.Message{keyed(watermill.NewUUID(), key, "a"), keyed(watermill.NewUUID(), key, "b")}
				wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				err := b.write(wctx, msgs, true, 0)
				cancel()
				if err != nil {
					failures.Add(1)
					continue
				}
				written.Add(int64(len(msgs)))
			}
		})
	}
	applied := func() int { return count(ctx, b.env.Pool, "SELECT count(*) FROM "+b.env.Q("effects")) }
	progress := func(what string) {
		t.Helper()
		from := max(applied(), 0)
		require.Eventually(t, func() bool { return applied() >= from+50 }, time.Minute, 20*time.Millisecond, what)
	}

	progress("messages flow before the first restart")
	require.NoError(t, srv.Restart(ctx, "fast", 0))
	progress("messages flow again after a fast restart")
	require.NoError(t, srv.Restart(ctx, "immediate", 0))
	progress("messages flow again after an immediate (crash) restart")
	close(stop)
	wg.Wait()
	t.Logf("%d messages written, %d producer transactions failed during the restarts", written.Load(), failures.Load())
	require.Positive(t, failures.Load(), "the restarts happened under load")

	// On a timeout the invariants below say what is missing.
	assert.Eventually(t, func() bool { return b.settled(ctx, []string{"ledger"}) }, 2*time.Minute, 50*time.Millisecond,
		"every committed message is applied and the outbox drains")
	requireNoViolations(t, b.outcome(t, []string{"ledger"}))
}
