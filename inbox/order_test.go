package inbox_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/txtest"
)

// Every way the README shows of putting Watermill's Retry outside the inbox, router-level or per
// handler, runs each try in a transaction of its own: the writes of a try that failed are rolled
// back, and only the try that succeeded commits. (Inside the inbox, Retry would re-run the handler
// in one transaction and commit both tries' writes.)
func TestRetryOutsideTheInboxCommitsOnlyTheTryThatSucceeded(t *testing.T) {
	t.Parallel()
	retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware
	for name, add := range map[string]func(r *message.Router, h *message.Handler, ib message.HandlerMiddleware){
		"router-level, inbox last": func(r *message.Router, _ *message.Handler, ib message.HandlerMiddleware) {
			r.AddMiddleware(retry, ib)
		},
		"per handler, inbox last": func(_ *message.Router, h *message.Handler, ib message.HandlerMiddleware) {
			h.AddMiddleware(retry, ib)
		},
		"retry router-level, inbox per handler": func(r *message.Router, h *message.Handler, ib message.HandlerMiddleware) {
			r.AddMiddleware(retry)
			h.AddMiddleware(ib)
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			pubsub, router := newRouter(t)
			var tries atomic.Int64
			h := b.handler(func(*message.Message) error { // After the handler's insert.
				if tries.Add(1) == 1 {
					return errors.New("the first try fails")
				}
				return nil
			})
			handler := router.AddConsumerHandler("h", "in", pubsub, func(msg *message.Message) error {
				_, err := h(msg)
				return err
			})
			add(router, handler, b.inbox.Middleware)
			txtest.RunRouter(t, router)

			msg := newMessage()
			require.NoError(t, pubsub.Publish("in", msg))
			require.Eventually(t, func() bool { return b.count(t, "txbox_inbox", "dedup_key = $1", msg.UUID) == 1 },
				time.Minute, 10*time.Millisecond)
			require.Equal(t, int64(2), tries.Load())
			require.Equal(t, 1, b.count(t, "effects", "id = $1", msg.UUID), "only the try that succeeded committed its write")
		})
	}
}
