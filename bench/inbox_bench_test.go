package bench

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/txtest"
)

// BenchmarkInboxRouter measures fresh messages through a Watermill router, as a consumer runs them:
// one handler reading a gochannel topic, one message at a time, inserting one business row. The
// baseline is the same handler in a router without the inbox, writing the row in a transaction of
// its own. inbox-fresh has poison-pill protection on (the default MaxAttempts); without it
// (MaxAttempts < 0) is for comparison.
func BenchmarkInboxRouter(b *testing.B) {
	b.Run("bare-handler", func(b *testing.B) {
		benchRouter(b, func(env *txtest.Env) (message.HandlerMiddleware, func(*message.Message) error) {
			return nil, func(m *message.Message) error {
				return pgx.BeginFunc(m.Context(), env.Pool, func(tx pgx.Tx) error { return applyEffect(m.Context(), env, tx, m) })
			}
		})
	})
	for _, v := range []struct {
		name        string
		maxAttempts int
	}{{"inbox-fresh", inbox.DefaultMaxAttempts}, {"inbox-fresh-no-attempt-count", -1}} {
		b.Run(v.name, func(b *testing.B) {
			benchRouter(b, func(env *txtest.Env) (message.HandlerMiddleware, func(*message.Message) error) {
				ib, err := inbox.New(inbox.Config{DB: env.Pool, Consumer: "bench", Schema: env.Schema, MaxAttempts: v.maxAttempts}, nil)
				if err != nil {
					b.Fatal(err)
				}
				return ib.Middleware, func(m *message.Message) error {
					tx, _ := inbox.TxFromContext(m.Context())
					return applyEffect(m.Context(), env, tx, m)
				}
			})
		})
	}
}

// benchRouter runs b.N messages through a router whose handler and middleware (nil: none) setup
// returns, and reports the rate from the first publish to the last message handled.
func benchRouter(b *testing.B, setup func(*txtest.Env) (message.HandlerMiddleware, func(*message.Message) error)) {
	env := newEffectsEnv(b)
	mw, handle := setup(env)
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: int64(b.N)}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		b.Fatal(err)
	}
	if mw != nil {
		router.AddMiddleware(mw)
	}
	var handled atomic.Int64
	all := make(chan struct{})
	router.AddConsumerHandler("bench", "orders.placed", pubsub, func(m *message.Message) error {
		if err := handle(m); err != nil {
			return err
		}
		if handled.Add(1) == int64(b.N) {
			close(all)
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- router.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-stopped; err != nil {
			b.Error(err)
		}
	}()
	<-router.Running()

	msgs := messages(b.N, false)
	b.ResetTimer()
	if err := pubsub.Publish("orders.placed", msgs...); err != nil {
		b.Fatal(err)
	}
	select {
	case <-all:
	case <-time.After(drainTimeout):
		b.Fatalf("%d of %d messages handled after %s", handled.Load(), b.N, drainTimeout)
	}
	b.StopTimer()
	reportRate(b, b.N)
}
