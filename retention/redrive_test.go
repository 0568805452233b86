package retention_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/retention"
)

// pass runs one retention pass with cfg (tb.cleaner's defaults where it leaves them).
func (tb *testBundle) pass(t *testing.T, cfg retention.Config) retention.Report {
	t.Helper()
	rep, err := tb.cleaner(t, cfg).RunOnce(context.Background())
	require.NoError(t, err)
	return rep
}

// redrive redrives the letters filter selects, unpaced, and returns how many went back.
func (tb *testBundle) redrive(t *testing.T, filter dlq.Filter) int {
	t.Helper()
	admin, err := dlq.NewAdmin(dlq.AdminConfig{Schema: tb.env.Schema})
	require.NoError(t, err)
	res, err := admin.Redrive(context.Background(), tb.env.Pool, filter, dlq.RedriveOptions{Rate: rate.Inf})
	require.NoError(t, err)
	return res.Moved
}

// redriven records a redrive of uuid on 'orders' ago.
func (tb *testBundle) redriven(t *testing.T, uuid string, ago time.Duration) {
	t.Helper()
	tb.exec(t, `INSERT INTO `+tb.env.Q("txbox_redrive")+` (message_uuid, topic, redriven_at) VALUES ($1, 'orders', now() - $2 * interval '1 second')`, uuid, ago.Seconds())
}

// Consumer X processed message M; consumer Y dead-lettered it. M is redriven: the copy is on the
// broker for its whole retention again, so X must remember M for InboxRetention from the redrive,
// not from its original processing.
func TestRedrivenMessagesAreRememberedForTheInboxRetentionFromTheRedrive(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	var (
		ran     = map[string]*atomic.Int64{"x": {}, "y": {}}
		settled = make(chan string, 16)
	)
	for _, consumer := range []string{"x", "y"} {
		ib, err := inbox.New(inbox.Config{DB: tb.env.Pool, Consumer: consumer, Schema: tb.env.Schema}, nil)
		require.NoError(t, err)
		router.AddConsumerHandler(consumer, "orders", pubsub, func(*message.Message) error {
			if ran[consumer].Add(1) == 1 && consumer == "y" {
				return fmt.Errorf("%w: y cannot yet", inbox.ErrUnprocessable)
			}
			return nil
		}).AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				require.NoError(t, err)
				settled <- consumer
				return out, err
			}
		}, ib.Middleware)
	}
	txtest.RunRouter(t, router)
	waitSettled := func() {
		t.Helper()
		for range 2 {
			select {
			case <-settled:
			case <-time.After(10 * time.Second):
				t.Fatal("a delivery was not settled")
			}
		}
	}

	m := message.NewMessage(watermill.NewUUID(), []byte("order 7"))
	require.NoError(t, pubsub.Publish("orders", m.Copy()))
	waitSettled()
	require.Equal(t, 1, tb.count(t, "txbox_dlq", "consumer = 'y'"))

	// Ten days on: X processed M then, Y gave up nine days ago.
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_inbox")+` SET received_at = now() - interval '10 days'`)
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_dlq")+` SET first_failed_at = now() - interval '9 days'`)
	require.Equal(t, 1, tb.redrive(t, dlq.Filter{Consumer: "y"}))

	// X's original horizon (processed 10 days ago, InboxRetention 8 days) has passed; the
	// redrive's has not.
	rep, err := tb.cleaner(t, retention.Config{BrokerRetention: 7 * day, InboxRetention: 8 * day}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "consumer = 'x' AND state = 'done'"), "X forgot M while its redriven copy can still reach it")
	require.Equal(t, int64(1), rep.RedrivenKept)

	// The redriven copy arrives (the relay would publish the outbox row): Y processes it, X skips it.
	require.NoError(t, pubsub.Publish("orders", m.Copy()))
	waitSettled()
	require.Equal(t, int64(1), ran["x"].Load(), "X processed M twice")
	require.Equal(t, int64(2), ran["y"].Load())

	// Once InboxRetention has passed since the redrive too, both rows and the redrive record go.
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_inbox")+` SET received_at = now() - interval '9 days'`)
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_redrive")+` SET redriven_at = now() - interval '9 days'`)
	rep, err = tb.cleaner(t, retention.Config{BrokerRetention: 7 * day, InboxRetention: 8 * day}).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2), rep.DoneDeleted)
	require.Zero(t, rep.RedrivenKept)
	require.Equal(t, int64(1), rep.RedrivesDeleted)
	require.Zero(t, tb.count(t, "txbox_redrive", "true"))
}

// A message an operator buries while the relay publishes it may reach consumers all the same:
// while its letter waits, and after it is redriven, the consumers that processed it keep their
// 'done' rows, as for an inbox letter. Before, relay letters counted for neither, and a consumer
// processed the redriven copy a second time.
func TestABuriedMessageIsRememberedWhileItsLetterWaitsAndAfterItsRedrive(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	w, err := outbox.New(outbox.Config{Schema: tb.env.Schema})
	require.NoError(t, err)
	m := message.NewMessage(watermill.NewUUID(), []byte("order 7"))
	require.NoError(t, pgx.BeginFunc(ctx, tb.env.Pool, func(tx pgx.Tx) error { return w.Publish(ctx, tx, "orders", m) }))
	var rowID int64
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT id FROM `+tb.env.Q("txbox_outbox")).Scan(&rowID))
	ra, err := relay.NewAdmin(relay.AdminConfig{Schema: tb.env.Schema})
	require.NoError(t, err)
	_, err = ra.Bury(ctx, tb.env.Pool, rowID, "stuck, looked at later")
	require.NoError(t, err)
	// X processed M ten days ago, as it was buried; the letter has waited nine.
	tb.exec(t, `INSERT INTO `+tb.env.Q("txbox_inbox")+` (consumer, dedup_key, message_uuid, topic, state, received_at)
		VALUES ('x', $1, $1, 'orders', 'done', now() - interval '10 days')`, m.UUID)
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_dlq")+` SET first_failed_at = now() - interval '9 days'`)
	clean := func() retention.Report {
		t.Helper()
		return tb.pass(t, retention.Config{BrokerRetention: 7 * day, InboxRetention: 8 * day})
	}

	rep := clean()
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "consumer = 'x'"), "X forgot M while its letter may still be redriven")
	require.InDelta(t, (9 * day).Seconds(), rep.OldestLetterAge.Seconds(), 60)

	require.Equal(t, 1, tb.redrive(t, dlq.Filter{Source: dlq.SourceRelay}))
	rep = clean()
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "consumer = 'x'"), "X forgot M while its redriven copy can still reach it")
	require.Equal(t, int64(1), rep.RedrivenKept)
}

// Consumer X processed M long ago; Y's letter of M was redriven, and Y dead-lettered the copy
// again. That second letter holds the cutoff back only from the rows of consumers that received
// M within the broker's retention before it, not from X's, received before the first redrive. So
// the record of the first redrive stays while a letter of M waits: without it, a pass dropped X's
// generation once an older letter that had held the cutoff back was gone, and X processed the
// copy that the second letter's redrive made.
func TestAMessageDeadLetteredAgainAfterItsRedriveIsRememberedUntilItsNextRedrive(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	// X processed M thirty days ago; a letter of another message, forty days old, holds the
	// cutoff back, so the generation X's row is in stays when the pass makes a new one.
	tb.inbox(t, "x", "m", "done", 1, 30*day)
	tb.letter(t, "inbox", "z", "other-1", 40*day)
	require.Empty(t, tb.pass(t, rotating).GenerationsDropped)

	// Y's letter of M was redriven twenty days ago, and Y dead-lettered the copy at once.
	tb.redriven(t, "m-1", 20*day)
	tb.inbox(t, "y", "m", "dead", 1, 20*day)
	tb.letter(t, "inbox", "y", "m-1", 20*day)
	require.Empty(t, tb.pass(t, retention.Config{}).GenerationsDropped, "the older letter still holds the cutoff back")

	// The older letter is discarded: now only Y's letter of M holds the cutoff back, to 28 days
	// ago, and X's generation goes.
	tb.exec(t, `DELETE FROM `+tb.env.Q("txbox_dlq")+` WHERE dedup_key = 'other-1'`)
	rep := tb.pass(t, retention.Config{})
	require.Equal(t, []int64{0}, rep.GenerationsDropped)
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "consumer = 'x'"), "X forgot M while a letter of it waits to be redriven")

	require.Equal(t, 1, tb.redrive(t, dlq.Filter{Consumer: "y"}))
	tb.pass(t, retention.Config{})

	// The second redrive's copy reaches X too.
	x := tb.consumer(t, inbox.Config{Consumer: "x", MaxAttempts: -1})
	require.NoError(t, x.deliver("m-1"))
	require.Zero(t, x.runs("m-1"), "X processed M twice")

	// Once InboxRetention has passed since the second redrive, the record goes.
	tb.exec(t, `UPDATE `+tb.env.Q("txbox_redrive")+` SET redriven_at = now() - interval '9 days'`)
	require.Equal(t, int64(1), tb.pass(t, retention.Config{}).RedrivesDeleted)
}

// A redriven message that Kafka refuses comes back to the DLQ as a relay letter. Kafka refused
// only the copy: consumers processed the original, and the letter's redrive sends them the
// message again, so that letter holds cleanup back like an inbox letter. Before, only buried relay
// letters did, and X forgot M while the letter waited.
func TestARedrivenMessageRefusedAgainIsRememberedUntilItsNextRedrive(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	// X processed M thirty days ago; M was redriven twenty days ago, and Kafka refused the copy.
	tb.inbox(t, "x", "m", "done", 1, 30*day)
	tb.redriven(t, "m-1", 20*day)
	tb.letter(t, "relay", "", "m-1", 20*day)
	rep := tb.pass(t, rotating)
	require.InDelta(t, (20 * day).Seconds(), rep.OldestLetterAge.Seconds(), 60)
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "consumer = 'x'"), "X forgot M while a letter of it waits to be redriven")

	require.Equal(t, 1, tb.redrive(t, dlq.Filter{Source: dlq.SourceRelay}))
	tb.pass(t, retention.Config{})
	x := tb.consumer(t, inbox.Config{Consumer: "x", MaxAttempts: -1})
	require.NoError(t, x.deliver("m-1"))
	require.Zero(t, x.runs("m-1"), "X processed M twice")
}
