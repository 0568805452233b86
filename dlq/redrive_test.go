package dlq_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/outbox"
)

type outboxRow struct {
	Topic, PartitionKey, UUID string
	Slot                      int16
	Payload                   []byte
	Metadata                  map[string]string
}

func (tb *testBundle) outboxRows(t *testing.T) []outboxRow {
	t.Helper()
	rows, err := tb.env.Pool.Query(context.Background(),
		`SELECT topic, partition_key, uuid, slot, payload, metadata::text FROM `+tb.env.Q("txbox_outbox")+` ORDER BY id`)
	require.NoError(t, err)
	defer rows.Close()
	var out []outboxRow
	for rows.Next() {
		var (
			r    outboxRow
			meta string
		)
		require.NoError(t, rows.Scan(&r.Topic, &r.PartitionKey, &r.UUID, &r.Slot, &r.Payload, &meta))
		require.NoError(t, json.Unmarshal([]byte(meta), &r.Metadata))
		out = append(out, r)
	}
	require.NoError(t, rows.Err())
	return out
}

func (tb *testBundle) count(t *testing.T, table, where string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, tb.env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tb.env.Q(table)+` WHERE `+where, args...).Scan(&n))
	return n
}

func (tb *testBundle) inboxRow(t *testing.T, consumer, key, state string) {
	t.Helper()
	_, err := tb.env.Pool.Exec(context.Background(), `INSERT INTO `+tb.env.Q("txbox_inbox")+` (consumer, dedup_key, message_uuid, topic, state)
		VALUES ($1, $2, $2, 'orders', $3)`, consumer, key, state)
	require.NoError(t, err)
}

func TestRedriveWritesTheMessageBackThroughTheOutbox(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()

	meta := map[string]string{outbox.PartitionKeyMetadata: "order-7", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	a := tb.add(t, dlq.Entry{UUID: "m-1", Topic: "orders", Consumer: "billing", DedupKey: "m-1", PartitionKey: "order-7",
		Payload: []byte(`{"order":7}`), Metadata: meta})
	relayLetter := tb.add(t, dlq.Entry{UUID: "m-2", Source: dlq.SourceRelay, Topic: "invoices", Payload: []byte("inv"),
		Metadata: map[string]string{outbox.ReservedMetadata: "m-2"}})
	// The inbox marked m-1 dead for billing; shipping processed it.
	tb.inboxRow(t, "billing", "m-1", "dead")
	tb.inboxRow(t, "shipping", "m-1", "done")

	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{IDs: []int64{a, relayLetter}}, dlq.RedriveOptions{Rate: rate.Inf})
	require.NoError(t, err)
	require.Equal(t, 2, res.Planned)
	require.Equal(t, 2, res.Moved)
	require.Equal(t, 1, res.Released)
	require.Equal(t, []dlq.TopicCount{{Topic: "orders", Kind: "message", Letters: 1}, {Topic: "invoices", Kind: "message", Letters: 1}}, res.Topics)

	rows := tb.outboxRows(t)
	require.Len(t, rows, 2)
	require.Equal(t, outboxRow{Topic: "orders", PartitionKey: "order-7", UUID: "m-1", Slot: outbox.SlotOf("order-7", "m-1"),
		Payload: []byte(`{"order":7}`), Metadata: meta}, rows[0])
	require.Equal(t, "invoices", rows[1].Topic)
	require.Equal(t, "m-2", rows[1].UUID)
	require.Equal(t, []byte("inv"), rows[1].Payload)
	require.Empty(t, rows[1].Metadata, "the UUID that came as metadata goes back as the message's UUID only")

	require.Zero(t, tb.count(t, "txbox_dlq", "true"))
	require.Zero(t, tb.count(t, "txbox_inbox", "consumer = 'billing'"), "billing must process the redriven message")
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "consumer = 'shipping' AND state = 'done'"), "shipping processed it and must skip the copy")
	require.Equal(t, 1, tb.count(t, "txbox_redrive", "message_uuid = 'm-1' AND topic = 'orders' AND redriven_at > now() - interval '1 minute'"),
		"the redrive is recorded, so retention keeps shipping's row for the copy")
	require.Equal(t, 1, tb.count(t, "txbox_redrive", "message_uuid = 'm-2' AND topic = 'invoices'"),
		"a relay letter's message may have reached consumers too, when it was buried as it was published")
}

func TestRedriveNeverReleasesADoneRow(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	// A letter whose consumer has a 'done' row for the key: the message was processed (say, by a
	// delivery that raced the one that gave up). Redriving must not make it processable again.
	id := tb.add(t, dlq.Entry{UUID: "m-1", Consumer: "billing", DedupKey: "m-1"})
	tb.inboxRow(t, "billing", "m-1", "done")

	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{IDs: []int64{id}}, dlq.RedriveOptions{Rate: rate.Inf})
	require.NoError(t, err)
	require.Equal(t, 1, res.Moved)
	require.Zero(t, res.Released)
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "consumer = 'billing' AND dedup_key = 'm-1' AND state = 'done'"))
}

// Deduplication is per handler: a letter names the handler that gave up, and a redrive releases
// exactly that handler's dead row. Another handler of the consumer that processed the message, or
// that gave up on it too and still has its letter waiting, keeps its row.
func TestRedriveReleasesExactlyTheHandlersDeadRow(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	charge := tb.add(t, dlq.Entry{UUID: "m-1", Consumer: "billing", Handler: "charge", DedupKey: "m-1"})
	tb.add(t, dlq.Entry{UUID: "m-1", Consumer: "billing", Handler: "audit", DedupKey: "m-1"})
	for handler, state := range map[string]string{"charge": "dead", "audit": "dead", "email": "done"} {
		_, err := tb.env.Pool.Exec(ctx, `INSERT INTO `+tb.env.Q("txbox_inbox")+` (consumer, dedup_key, handler, message_uuid, topic, state)
			VALUES ('billing', 'm-1', $1, 'm-1', 'orders', $2)`, handler, state)
		require.NoError(t, err)
	}

	letters, err := tb.admin.List(ctx, tb.env.Pool, dlq.Filter{Handler: "charge"})
	require.NoError(t, err)
	require.Len(t, letters, 1)
	require.Equal(t, charge, letters[0].ID)
	require.Equal(t, "charge", letters[0].Handler)
	require.False(t, dlq.Filter{Handler: "charge"}.IsEmpty())

	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{Consumer: "billing", Handler: "charge"}, dlq.RedriveOptions{Rate: rate.Inf})
	require.NoError(t, err)
	require.Equal(t, 1, res.Moved)
	require.Equal(t, 1, res.Released)
	require.Zero(t, tb.count(t, "txbox_inbox", "handler = 'charge'"))
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "handler = 'audit' AND state = 'dead'"), "its letter still waits")
	require.Equal(t, 1, tb.count(t, "txbox_inbox", "handler = 'email' AND state = 'done'"))
	require.Equal(t, 1, tb.count(t, "txbox_dlq", "handler = 'audit'"))
}

func TestRedriveConcurrentRedrivesMoveEachLetterOnce(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	const n = 3000
	tb.addMany(t, n, dlq.SourceInbox, "orders", "m")
	_, err := tb.env.Pool.Exec(ctx, `INSERT INTO `+tb.env.Q("txbox_inbox")+` (consumer, dedup_key, message_uuid, topic, state)
		SELECT consumer, dedup_key, uuid, topic, 'dead' FROM `+tb.env.Q("txbox_dlq"))
	require.NoError(t, err)

	var (
		wg      sync.WaitGroup
		results [2]dlq.RedriveResult
		errs    [2]error
	)
	for i := range 2 {
		wg.Go(func() {
			results[i], errs[i] = tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{Source: dlq.SourceInbox},
				dlq.RedriveOptions{Rate: rate.Inf, BatchSize: 25})
		})
	}
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Equal(t, n, results[0].Moved+results[1].Moved)
	require.Equal(t, n, results[0].Released+results[1].Released)

	require.Equal(t, n, tb.count(t, "txbox_outbox", "true"))
	var dupes int
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT uuid FROM `+tb.env.Q("txbox_outbox")+
		` GROUP BY uuid HAVING count(*) > 1) AS d`).Scan(&dupes))
	require.Zero(t, dupes)
	require.Zero(t, tb.count(t, "txbox_dlq", "true"))
	require.Zero(t, tb.count(t, "txbox_inbox", "true"))
}

// Letters another redrive holds are skipped, not waited for; if that redrive then rolls back,
// they are still in the DLQ behind this redrive's cursor, and this redrive must not report its
// work done without them.
func TestRedriveMovesLettersItSkippedWhenTheirHolderRollsBack(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.addMany(t, 30, dlq.SourceInbox, "orders", "o")

	// The other redrive, as its first batch: it holds the ten lowest letters.
	other, err := tb.env.Pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx) //nolint:errcheck // Rolled back below.
	held, err := other.Exec(ctx, `SELECT id FROM `+tb.env.Q("txbox_dlq")+` ORDER BY id LIMIT 10 FOR UPDATE`)
	require.NoError(t, err)
	require.EqualValues(t, 10, held.RowsAffected())

	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{Topic: "orders"}, dlq.RedriveOptions{
		Rate: rate.Inf, BatchSize: 10,
		Progress: func(p dlq.RedriveProgress) {
			if p.Moved == 10 { // This redrive has passed the held letters: the other one fails.
				require.NoError(t, other.Rollback(ctx))
			}
		},
	})
	require.NoError(t, err)
	require.Equal(t, 30, res.Moved)
	require.Equal(t, 30, tb.count(t, "txbox_outbox", "true"))
	require.Zero(t, tb.count(t, "txbox_dlq", "true"))
}

// A redrive, and its dry run, refuse a selection holding a letter that cannot go back to the
// outbox, naming it, before anything moves: a side-effect call (it may have reached the provider),
// or a message that had no id (the outbox needs one). A narrower selection moves the rest.
func TestRedriveRefusesWhatCannotGoBackToTheOutbox(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		bad     dlq.Entry
		noTopic bool // the test bundle's add gives every letter one
		want    error
		narrow  dlq.Filter
	}{
		"call": {
			bad: dlq.Entry{UUID: "c-1", Source: dlq.SourceRelay, Kind: "call", Topic: "charges.replies",
				IdempotencyKey: "idem-1", Reason: "key past the provider's replay window"},
			want: dlq.ErrCallNotRedrivable, narrow: dlq.Filter{Source: dlq.SourceRelay, Kind: "message"},
		},
		"message without an id": {
			bad:  dlq.Entry{Source: dlq.SourceRelay, Topic: "orders", Reason: "no usable id"},
			want: dlq.ErrNoMessageID, narrow: dlq.Filter{Source: dlq.SourceRelay, Reason: "exhausted"},
		},
		// The inbox dead-letters a message whose id is over the outbox's limit, which would refuse it.
		"message with an id over the outbox's limit": {
			bad: dlq.Entry{UUID: strings.Repeat("u", outbox.MaxUUIDBytes+1), Source: dlq.SourceRelay, Topic: "orders",
				Reason: "no usable id"},
			want: dlq.ErrNoMessageID, narrow: dlq.Filter{Source: dlq.SourceRelay, Reason: "exhausted"},
		},
		// An inbox outside a router knows no topic.
		"message without a topic": {
			bad: dlq.Entry{UUID: "m-3", Source: dlq.SourceRelay, Reason: "no usable id"}, noTopic: true,
			want: dlq.ErrNoTopic, narrow: dlq.Filter{Source: dlq.SourceRelay, Reason: "exhausted"},
		},
		// The inbox dead-letters what is over its limit; the outbox would refuse it the same way.
		"payload over the outbox's limit": {
			bad: dlq.Entry{UUID: "m-4", Source: dlq.SourceRelay, Topic: "orders", Reason: "payload too large",
				Payload: make([]byte, outbox.DefaultMaxPayloadBytes+1)},
			want: dlq.ErrTooLarge, narrow: dlq.Filter{Source: dlq.SourceRelay, Reason: "exhausted"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			ctx := context.Background()
			tb.add(t, dlq.Entry{UUID: "m-1", Source: dlq.SourceRelay, Topic: "orders", Reason: "attempts exhausted"})
			bad := tb.add(t, c.bad)
			if c.noTopic {
				_, err := tb.env.Pool.Exec(ctx, "UPDATE "+tb.env.Q("txbox_dlq")+" SET topic = '' WHERE id = $1", bad)
				require.NoError(t, err)
			}
			tb.add(t, dlq.Entry{UUID: "m-2", Source: dlq.SourceRelay, Topic: "orders", Reason: "attempts exhausted"})

			for _, dry := range []bool{true, false} {
				_, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{Source: dlq.SourceRelay}, dlq.RedriveOptions{Rate: rate.Inf, DryRun: dry})
				require.ErrorIs(t, err, c.want)
				require.ErrorContains(t, err, fmt.Sprintf("1 such letter(s), ids %d", bad))
				require.Zero(t, tb.count(t, "txbox_outbox", "true"), "nothing moves")
				require.Equal(t, 3, tb.count(t, "txbox_dlq", "true"))
			}

			res, err := tb.admin.Redrive(ctx, tb.env.Pool, c.narrow, dlq.RedriveOptions{Rate: rate.Inf})
			require.NoError(t, err)
			require.Equal(t, 2, res.Moved)
			require.Equal(t, 1, tb.count(t, "txbox_dlq", "id = $1", bad))
		})
	}
}

func TestRedriveDryRunMovesNothing(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.addMany(t, 30, dlq.SourceInbox, "orders", "o")
	tb.addMany(t, 20, dlq.SourceRelay, "invoices", "i")

	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{All: true}, dlq.RedriveOptions{Rate: 1, DryRun: true})
	require.NoError(t, err)
	require.Equal(t, 50, res.Planned)
	require.Zero(t, res.Moved)
	require.Equal(t, []dlq.TopicCount{{Topic: "orders", Kind: "message", Letters: 30}, {Topic: "invoices", Kind: "message", Letters: 20}}, res.Topics)
	require.Zero(t, tb.count(t, "txbox_outbox", "true"))
	require.Equal(t, 50, tb.count(t, "txbox_dlq", "true"))
}

func TestRedriveRefusesUnsafeOptions(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.addMany(t, 3, dlq.SourceInbox, "orders", "o")

	_, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{}, dlq.RedriveOptions{Rate: rate.Inf})
	require.ErrorIs(t, err, dlq.ErrEmptyFilter)
	_, err = tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{All: true}, dlq.RedriveOptions{})
	require.ErrorContains(t, err, "RedriveOptions.Rate is required")
	_, err = tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{All: true}, dlq.RedriveOptions{Rate: -1})
	require.ErrorContains(t, err, "RedriveOptions.Rate")
	require.Equal(t, 3, tb.count(t, "txbox_dlq", "true"))
}

func TestRedriveLimitAndOrder(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.addMany(t, 10, dlq.SourceInbox, "orders", "o")

	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{All: true, Limit: 4}, dlq.RedriveOptions{Rate: rate.Inf, BatchSize: 3})
	require.NoError(t, err)
	require.Equal(t, 4, res.Planned)
	require.Equal(t, 4, res.Moved)
	var uuids []string
	for _, r := range tb.outboxRows(t) {
		uuids = append(uuids, r.UUID)
	}
	require.Equal(t, []string{"o-1", "o-2", "o-3", "o-4"}, uuids, "letters move in id order")
}

// Interrupting a redrive leaves every letter either moved or still in the DLQ, and running it
// again moves the rest.
func TestRedriveInterruptedAndRunAgain(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.addMany(t, 100, dlq.SourceInbox, "orders", "o")

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	res, err := tb.admin.Redrive(runCtx, tb.env.Pool, dlq.Filter{Topic: "orders"}, dlq.RedriveOptions{
		Rate: rate.Inf, BatchSize: 10,
		Progress: func(p dlq.RedriveProgress) {
			if p.Moved >= 30 {
				cancel()
			}
		},
	})
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 30, res.Moved)
	require.Equal(t, 30, tb.count(t, "txbox_outbox", "true"))
	require.Equal(t, 70, tb.count(t, "txbox_dlq", "true"))

	res, err = tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{Topic: "orders"}, dlq.RedriveOptions{Rate: rate.Inf, BatchSize: 10})
	require.NoError(t, err)
	require.Equal(t, 70, res.Moved)
	require.Equal(t, 100, tb.count(t, "txbox_outbox", "true"))
	require.Zero(t, tb.count(t, "txbox_dlq", "true"))
}

// A paced redrive under a deadline stops with context.DeadlineExceeded as soon as the next batch's
// wait would outlast the deadline: the limiter refuses that wait before the deadline passes, while
// ctx.Err is still nil, and a caller branching on the deadline must still see it.
func TestRedriveUnderADeadlineStopsWithDeadlineExceeded(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.addMany(t, 3, dlq.SourceInbox, "orders", "o")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// One letter every 100 s: the first moves with the full bucket, the second would wait past the deadline.
	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{Topic: "orders"}, dlq.RedriveOptions{Rate: 0.01, Burst: 1})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NoError(t, ctx.Err(), "the redrive stopped before the deadline, not at it")
	require.ErrorContains(t, err, "redrive stopped after 1 of 3 letters")
	require.Equal(t, 1, res.Moved)
	require.Equal(t, 1, tb.count(t, "txbox_outbox", "true"))
	require.Equal(t, 2, tb.count(t, "txbox_dlq", "true"))
}

// A message that fails again while the redrive runs comes back as a new letter; the same run must
// not pick it up again, or a persistently failing message would circle for ever.
func TestRedriveSelectionIsFixedAtStart(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	tb.addMany(t, 20, dlq.SourceInbox, "orders", "o")

	added := 0
	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{Topic: "orders"}, dlq.RedriveOptions{
		Rate: rate.Inf, BatchSize: 5,
		Progress: func(dlq.RedriveProgress) {
			added++
			tb.add(t, dlq.Entry{UUID: fmt.Sprint("again-", added), Topic: "orders"})
		},
	})
	require.NoError(t, err)
	require.Equal(t, 20, res.Moved)
	require.Equal(t, added, tb.count(t, "txbox_dlq", "true"))
}

// The limiter, not the database, sets the pace: 10,000 letters at 5,000 a second with a burst of
// 50 cannot take less than (10,000 - 50) / 5,000 seconds, whatever the machine's speed.
func TestRedrivePacing(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := context.Background()
	const (
		n     = 10_000
		limit = 5000.0
		burst = 50
	)
	tb.addMany(t, n, dlq.SourceRelay, "orders", "o")

	var progress []dlq.RedriveProgress
	start := time.Now()
	res, err := tb.admin.Redrive(ctx, tb.env.Pool, dlq.Filter{Source: dlq.SourceRelay},
		dlq.RedriveOptions{Rate: limit, Burst: burst, Progress: func(p dlq.RedriveProgress) { progress = append(progress, p) }})
	elapsed := time.Since(start)
	require.NoError(t, err)
	require.Equal(t, n, res.Moved)
	require.Equal(t, n, tb.count(t, "txbox_outbox", "true"))
	require.Zero(t, tb.count(t, "txbox_dlq", "true"))

	minElapsed := time.Duration(float64(n-burst) / limit * float64(time.Second))
	require.GreaterOrEqual(t, elapsed, minElapsed)

	// The batches are no larger than the burst, and progress is reported after each.
	require.Len(t, progress, n/burst)
	require.Equal(t, dlq.RedriveProgress{Moved: n, Total: n, Elapsed: progress[len(progress)-1].Elapsed}, progress[len(progress)-1])

	// The rate at which rows appear in the outbox, by their created_at (each batch's transaction
	// start): the first batch's rows come with the full bucket, the rest are paced. The 5% allows
	// for the time between the limiter granting the first batch and its transaction starting,
	// which the timestamps cannot see.
	var span float64
	require.NoError(t, tb.env.Pool.QueryRow(ctx, `SELECT extract(epoch FROM max(created_at) - min(created_at))::float8 FROM `+
		tb.env.Q("txbox_outbox")).Scan(&span))
	observed := float64(n-burst) / span
	t.Logf("moved %d letters in %s; outbox rows appeared at %.0f/s (limit %.0f/s)", n, elapsed, observed, limit)
	require.LessOrEqual(t, observed, limit*1.05)
}
