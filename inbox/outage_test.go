package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/pgserver"
	"github.com/txbox/txbox/internal/txtest"
)

// PostgreSQL restarts while the message is in its handler, more times than MaxAttempts, each
// outage long enough that the inbox cannot record the end of the attempt either: the handler's
// failures are the server's, so they use up no attempts, and the unrecorded ends must not pass for
// crashes at the next deliveries (which would run the message alone and charge those runs, cut off
// by the next restart, as crashes). The message is processed once, never dead-lettered. A
// throwaway server is used so the machine's shared one is never restarted.
func TestPostgresRestartsInTheHandlerDoNotUseUpAttempts(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, err := pgserver.StartThrowaway(ctx, t.Logf)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, srv.Stop()) })
	b := setupIn(t, txtest.NewIn(t, srv.URL), nil) // MaxAttempts: 3

	const restarts = 4
	restarted := make(chan error, restarts)
	h := b.inbox.Middleware(b.handler(func(msg *message.Message) error {
		if b.calls.Load() > restarts {
			return nil
		}
		go func() { restarted <- srv.Restart(ctx, "fast", 300*time.Millisecond) }()
		// The handler's own statements fail once the shutdown ends its session.
		tx, _ := inbox.TxFromContext(msg.Context())
		for {
			if _, err := tx.Exec(msg.Context(), "SELECT 1"); err != nil {
				return err
			}
			time.Sleep(10 * time.Millisecond)
		}
	}))
	msg := newMessage()
	failures := 0
	for deliver(h, msg) != nil {
		failures++
		require.NoError(t, ctx.Err(), "still not processed after %d deliveries", failures)
		time.Sleep(50 * time.Millisecond) // A router's retry: this one may meet the server down.
	}
	require.Zero(t, b.count(t, "txbox_dlq", ""), "a healthy message was dead-lettered")
	require.EqualValues(t, restarts+1, b.calls.Load(), "the handler ran once per restart, then once more")
	for range restarts {
		require.NoError(t, <-restarted)
	}
	require.GreaterOrEqual(t, failures, restarts)
	require.Equal(t, 1, b.count(t, "effects", "id = $1", msg.UUID))
	require.Equal(t, 1, b.count(t, "txbox_inbox", "state = 'done'"))
}
