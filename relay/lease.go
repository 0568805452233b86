package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/outbox"
)

// lease is one shard held under one fencing token, and the worker that publishes its rows.
type lease struct {
	relay *Relay
	shard int
	token int64
	slots []int16

	ctx    context.Context // cancelled when the lease is lost: abandon work at once
	cancel context.CancelFunc
	stop   chan struct{} // closed for a graceful stop: finish the batch in flight first
	done   chan struct{}
	// forgotten is closed once the relay no longer counts the lease as held.
	forgotten chan struct{}

	failures int // consecutive failed cycles, for backoff and for logging a failure streak once

	// until is when the lease runs out at the latest, by the relay's clock: one LeaseTTL after the
	// transaction that took or last renewed it began (dropRunOut). Run's goroutine only.
	until time.Time

	// While the broker refuses a batch of several messages, the worker halves its batches until
	// the refused message is published alone (see RejectedError): window is the batch size, and
	// narrowed the highest id of the refused batch, 0 when not narrowing.
	window   int
	narrowed int64

	// parked is set while the worker waits for watch to find rows in its slots (wake).
	parked atomic.Bool
	wake   chan struct{}
	// dueSlot is the one slot the look that woke the worker found rows in, noSlot when it found
	// several or the worker was woken otherwise: the worker's next read reads that slot alone.
	dueSlot atomic.Int32

	// ahead is the next batch, read by the last completion when readAhead is set.
	ahead     []pendingRow
	readAhead bool
	// uncompleted holds the rows the broker has but whose completion failed, for the next cycle to
	// complete before it reads.
	uncompleted completion
}

// completion names the rows of a batch the broker has, for their completion: tids[i] is where row
// ids[i] was read (see completeMessages).
type completion struct {
	tids []pgtype.TID
	ids  []int64
}

// pendingRow is one outbox row read for publishing.
type pendingRow struct {
	tid          pgtype.TID // where the row was read, to delete it without an index look-up
	id           int64
	topic        string
	partitionKey string
	uuid         string
	payload      []byte
	metadata     string
	attempts     int // publish attempts the broker refused so far
	// over marks the row that ends a read cut to BatchBytes: the first row left out, read without
	// its payload and metadata, there only to say that more rows are due.
	over bool
}

// scanPending reads a row of the readMessages query.
func scanPending(row pgx.CollectableRow) (pendingRow, error) {
	var p pendingRow
	err := row.Scan(&p.tid, &p.id, &p.topic, &p.partitionKey, &p.uuid, &p.payload, &p.metadata, &p.attempts, &p.over)
	return p, err
}

// errRefused reports a cycle whose batch the broker refused in part, now dealt with (the batch
// narrowed, or the refused message retried later or dead): the next cycle runs at once, with a new
// producer, whose client has forgotten the refusal (sarama stops trying a topic for 10 s after
// three failures to find it).
var errRefused = errors.New("relay: the broker refused a message")

// run publishes the shard's rows until the lease ends. It reports true when the lease was found
// superseded, so the relay drops it.
func (l *lease) run() (fenced bool) {
	r := l.relay
	l.window = r.cfg.BatchSize
	var pub ShardPublisher
	defer func() {
		if pub != nil {
			_ = pub.Close()
		}
		r.publishing.settle(l.shard, 0)
	}()
	for {
		select {
		case <-l.stop:
			return false
		case <-l.ctx.Done():
			return false
		default:
		}
		var (
			n    int
			more bool
			err  error
		)
		if pub == nil {
			pub, err = l.open()
		}
		if err == nil {
			n, more, err = l.cycle(pub)
		}
		switch {
		case errors.Is(err, ErrFenced):
			if pub != nil {
				_ = pub.Close() // A fenced producer is never used again.
				pub = nil
			}
			// The broker fences a producer when another one opens the shard's transactional.id. If
			// the database still says the lease is ours, that was a relay whose lease had ended
			// opening it late (it gives the shard up at its next check): open a new producer,
			// which fences that one in turn. If the database cannot say right now, the lease is
			// still ours as far as we know: opening the next producer checks it again.
			err := l.fenced(l.ctx, checkOnly)
			if errors.Is(err, ErrFenced) {
				return true
			}
			if l.ctx.Err() != nil {
				return false
			}
			l.failures++
			if err != nil {
				r.log.Warn("producer fenced, and could not check the lease; keeping the shard and checking again", "shard", l.shard, "token", l.token, "error", err)
			} else {
				r.log.Warn("producer fenced while the lease is still ours; opening a new one", "shard", l.shard, "token", l.token)
			}
			l.wait(backoff(l.failures))
		case errors.Is(err, errRefused):
			_ = pub.Close()
			pub = nil
		case err != nil && l.ctx.Err() != nil:
			return false
		case err != nil:
			l.failures++
			r.metrics.PublishErrors.Inc()
			r.publishing.fail(l.shard, err)
			// A failed Kafka transaction can leave the producer unusable; a fresh one is cheap.
			if pub != nil {
				_ = pub.Close()
				pub = nil
			}
			l.wait(backoff(l.failures))
		default:
			if l.failures > 0 {
				r.publishing.settle(l.shard, l.failures)
				l.failures = 0
			}
			if !more {
				l.park(n > 0)
			}
		}
	}
}

// awaitBroker runs call, which waits for the broker, and reports publishing as failing for the
// shard while call has not returned after one LeaseTTL: sarama keeps retrying a broker that takes
// connections but does not answer (a frozen or overloaded one) for minutes, without an error the
// relay could log or Ready could show. An answer after that ends the shard's part in the outage.
func (l *lease) awaitBroker(call func() error) error {
	r := l.relay
	silence := time.AfterFunc(r.cfg.LeaseTTL, func() {
		r.publishing.fail(l.shard, fmt.Errorf("the broker has not answered for %v", r.cfg.LeaseTTL))
	})
	err := call()
	if !silence.Stop() && err == nil {
		r.publishing.settle(l.shard, 1)
	}
	return err
}

// open creates the shard's publisher after checking the lease is still ours: opening a Kafka
// transactional producer fences whoever holds the shard's transactional.id, and that should never
// be a newer owner. A relay can pause between the check and the open, though, and then fence the
// newer owner's producer (which opens a new one, see run); so the lease is checked again once the
// producer is open, and a relay that lost it meanwhile publishes nothing through it.
func (l *lease) open() (ShardPublisher, error) {
	if err := l.fenced(l.ctx, checkOnly); err != nil {
		return nil, err
	}
	failpoint.HitContext(l.ctx, "relay.before-open")
	var pub ShardPublisher
	err := l.awaitBroker(func() (err error) {
		pub, err = l.relay.cfg.Sink.Open(l.ctx, l.shard, l.token)
		return err
	})
	if err != nil {
		return nil, err
	}
	if err := l.fenced(l.ctx, checkOnly); err != nil {
		_ = pub.Close()
		return nil, err
	}
	return pub, nil
}

// checkOnly is a fenced transaction's body when the check is all that is wanted.
func checkOnly(pgx.Tx) error { return nil }

// cycle reads one batch, publishes it and completes it. It returns how many rows it published, and
// whether more rows were due than the batch held (it was cut by BatchSize or BatchBytes, or before
// a refused message), so that the next cycle should run at once.
func (l *lease) cycle(pub ShardPublisher) (published int, more bool, err error) {
	r := l.relay
	if n := len(l.uncompleted.ids); n > 0 {
		// The broker has these rows, but the completion that deletes them failed (a connection
		// lost): delete them first, or the read below would publish them again.
		if err := l.complete(l.uncompleted, false); err != nil {
			return 0, false, err
		}
		r.metrics.Published.Add(float64(n))
		l.uncompleted = completion{}
	}
	batch, err := l.next()
	if err != nil {
		return 0, false, err
	}
	if len(batch) == 0 {
		return 0, false, nil
	}
	failpoint.HitContext(l.ctx, "relay.after-read")
	batch, more = cut(batch, l.window)
	if alone := aloneIfRefused(batch); len(alone) < len(batch) {
		batch, more = alone, true
	}

	msgs := make([]Message, len(batch))
	done := completion{tids: make([]pgtype.TID, len(batch)), ids: make([]int64, len(batch))}
	for i, p := range batch {
		msgs[i] = l.toMessage(p)
		done.tids[i], done.ids[i] = p.tid, p.id
	}
	spans := l.startPublishSpans(msgs)
	err = l.awaitBroker(func() error { return pub.Publish(l.ctx, msgs) })
	endPublishSpans(spans, msgs, err)
	if err != nil {
		var refused *RejectedError
		switch {
		case !errors.As(err, &refused):
			return 0, false, err
		case len(batch) > 1:
			l.window = max(1, len(batch)/2)
			l.narrowed = max(l.narrowed, batch[len(batch)-1].id)
			r.log.Debug("the broker refused a batch; publishing smaller ones to find the refused message",
				"shard", l.shard, "batch", len(batch), "next_batch", l.window, "error", refused)
			return 0, false, errRefused
		}
		cause, permanent := refused.cause(0)
		if cause == nil {
			return 0, false, fmt.Errorf("relay: a publisher refused a message without saying why: %w", err)
		}
		if err := l.refuse(batch[0], cause, permanent); err != nil {
			return 0, false, err
		}
		l.window, l.narrowed = r.cfg.BatchSize, 0
		return 0, false, errRefused
	}
	failpoint.HitContext(l.ctx, "relay.after-publish")

	if err := l.complete(done, more); err != nil {
		l.uncompleted = done
		return 0, false, err
	}
	failpoint.HitContext(l.ctx, "relay.after-complete")
	r.metrics.Published.Add(float64(len(batch)))
	if l.narrowed != 0 && batch[len(batch)-1].id >= l.narrowed {
		l.window, l.narrowed = r.cfg.BatchSize, 0 // Past the refused batch.
	}
	return len(batch), more, nil
}

// next returns the batch to publish: the rows the last completion read ahead, or a fresh read.
func (l *lease) next() ([]pendingRow, error) {
	if l.readAhead {
		batch := l.ahead
		l.ahead, l.readAhead = nil, false
		return batch, nil
	}
	r := l.relay
	// The read of one slot costs ~120 µs of a round trip here against ~300 µs for the read of a
	// shard's 16 (one branch each), and at a moderate rate that read is much of the time from a
	// row's commit to its publish. Rows that came to the shard's other slots since the look wait
	// for the next one; the slot's own order is the same either way.
	query, slots := r.sql.readMessages, l.slots
	if s := l.dueSlot.Swap(noSlot); s != noSlot {
		query, slots = r.sql.readSlotMessages, []int16{int16(s)}
	}
	var batch []pendingRow
	err := r.read(l.ctx, query, []any{slots, l.window, r.cfg.BatchBytes}, func(rows pgx.Rows) (err error) {
		batch, err = pgx.CollectRows(rows, scanPending)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("relay: read shard %d: %w", l.shard, err)
	}
	return batch, nil
}

// complete deletes the published rows in a fenced transaction, in one round trip with the lease
// check. With readAhead (more rows were due than the batch held) the same round trip
// reads the next batch, which the next cycle publishes without a read of its own: the read runs
// after the delete, in its transaction, so it never returns a row just completed, and like every
// read it returns what is committed when it runs, late commits included.
func (l *lease) complete(done completion, readAhead bool) error {
	r := l.relay
	var ahead []pendingRow
	err := l.fencedWith(l.ctx, func(b *pgx.Batch) {
		b.Queue(r.sql.completeMessages, done.tids, done.ids, l.shard, l.token)
		if readAhead {
			b.Queue(r.sql.readMessages, l.slots, l.window, r.cfg.BatchBytes).Query(func(rows pgx.Rows) error {
				var err error
				ahead, err = pgx.CollectRows(rows, scanPending)
				return err
			})
		}
	}, checkOnly)
	if err != nil {
		return err
	}
	l.ahead, l.readAhead = ahead, readAhead
	return nil
}

// cut drops the row a read of at most limit rows ends with when BatchBytes cut it short (see
// pendingRow.over), and reports whether more rows may be due than the batch holds: the read was
// cut, or returned its limit.
func cut(batch []pendingRow, limit int) ([]pendingRow, bool) {
	if n := len(batch); batch[n-1].over {
		return batch[:n-1], true
	}
	return batch, len(batch) == limit
}

// aloneIfRefused cuts batch before the first message the broker refused before, or to that message
// alone when it comes first: a refused message is published on its own, so a refusal is pinned on it
// without publishing smaller and smaller batches again. Later messages of its key are not in the
// batch: the read holds them back while it waits for its next attempt.
func aloneIfRefused(batch []pendingRow) []pendingRow {
	for i, p := range batch {
		if p.attempts > 0 {
			return batch[:max(i, 1)]
		}
	}
	return batch
}

func (l *lease) toMessage(p pendingRow) Message {
	msg := message.NewMessage(p.uuid, p.payload)
	// The metadata was encoded by the outbox from a map[string]string; it always decodes.
	_ = json.Unmarshal([]byte(p.metadata), &msg.Metadata)
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	msg.Metadata.Set(outbox.ShardMetadata, strconv.Itoa(l.shard))
	msg.Metadata.Set(outbox.TokenMetadata, strconv.FormatInt(l.token, 10))
	return Message{Topic: p.topic, Key: p.partitionKey, Msg: msg, Partition: -1, Offset: -1}
}

// refuse deals with a message the broker refused when published alone: one refused for good goes to
// the dead-letter table at once; one refused for a reason that may pass counts the attempt and waits
// for its next one, holding back the later messages of its key, until MaxPublishAttempts sends it to
// the dead-letter table too. Later messages of its key are not held back by a dead message: it
// waits for a person, and blocking its key would stop every later message of it too.
func (l *lease) refuse(p pendingRow, cause error, permanent bool) error {
	r := l.relay
	reason := ReasonRejected
	attempts := p.attempts + 1
	err := l.fenced(l.ctx, func(tx pgx.Tx) error {
		if !permanent {
			wait := retryDelay(r.cfg.MinPublishBackoff, r.cfg.MaxPublishBackoff, attempts, 0)
			err := tx.QueryRow(l.ctx, r.sql.refuseMessage, p.id, cause.Error(), wait.Milliseconds()).Scan(&attempts)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil // Settled meanwhile (buried by an operator).
			}
			if err != nil || attempts < r.cfg.MaxPublishAttempts {
				return err
			}
			reason = ReasonPublishAttemptsExhausted
		}
		return l.bury(tx, p, reason, cause.Error(), attempts)
	})
	if err != nil {
		return err
	}
	r.metrics.PublishErrors.Inc()
	switch {
	case permanent || attempts >= r.cfg.MaxPublishAttempts:
		r.metrics.DeadLetters.WithLabelValues(string(dlq.SourceRelay), reason).Inc()
		r.log.Error("message refused by the broker; moved to the dead-letter table", "shard", l.shard, "message_uuid", p.uuid,
			"topic", p.topic, "reason", reason, "attempts", attempts, "error", cause)
	case attempts == 1:
		// One line per refused message, not one per attempt: the row's last_error has the latest.
		r.log.Warn("message refused by the broker; retrying it with backoff while later messages of its key wait",
			"shard", l.shard, "message_uuid", p.uuid, "topic", p.topic, "max_attempts", r.cfg.MaxPublishAttempts, "error", cause)
	}
	return nil
}

// bury moves an outbox row to the dead-letter table in tx, unless it is gone already (completed, or
// buried by an operator): a row is never both pending and dead, nor dead twice.
func (l *lease) bury(tx pgx.Tx, p pendingRow, reason, detail string, attempts int) error {
	r := l.relay
	first, ok, err := r.deleteForBurial(l.ctx, tx, p.id)
	if err != nil || !ok {
		return err
	}
	var meta map[string]string
	_ = json.Unmarshal([]byte(p.metadata), &meta)
	return r.dead.Add(l.ctx, tx, dlq.Entry{
		Source: dlq.SourceRelay, Topic: p.topic, PartitionKey: p.partitionKey, UUID: p.uuid,
		Payload: p.payload, Metadata: meta, Reason: reason, Error: detail, Attempts: attempts, FirstFailedAt: first,
	})
}

// deleteForBurial deletes outbox row id in tx on its way to the dead-letter table. It returns when
// the row's first attempt failed (zero when none was counted), and false when the row is gone
// already.
func (r *Relay) deleteForBurial(ctx context.Context, tx pgx.Tx, id int64) (first time.Time, ok bool, err error) {
	var at pgtype.Timestamptz
	err = tx.QueryRow(ctx, r.sql.buryRow, id).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, false, nil
	}
	return at.Time, err == nil, err
}

// fenced runs fn in a transaction that first locks the shard's lease row and checks that the token
// is still ours; it returns an error wrapping ErrFenced when it is not, and another error when it
// could not tell. A bare "WHERE token = mine" on the write is not enough: a takeover could commit
// between that check and the write. Holding the lock, a takeover waits for us instead.
func (l *lease) fenced(ctx context.Context, fn func(pgx.Tx) error) error {
	return l.fencedWith(ctx, nil, fn)
}

// fencedWith is fenced with the statements then queues sent in the same round trip as the check,
// right after it. They reach PostgreSQL before the check's answer reaches the relay, so each must
// change nothing unless the lease is still ours by itself (completeMessages).
func (l *lease) fencedWith(ctx context.Context, then func(*pgx.Batch), fn func(pgx.Tx) error) error {
	r := l.relay
	check := func(b *pgx.Batch) {
		b.Queue(r.sql.checkLease, l.shard, l.token).QueryRow(func(row pgx.Row) error {
			var one int
			err := row.Scan(&one)
			if errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("%w: shard %d token %d superseded in the database", ErrFenced, l.shard, l.token)
			}
			if err != nil {
				return fmt.Errorf("relay: lock lease of shard %d: %w", l.shard, err)
			}
			return nil
		})
		if then != nil {
			then(b)
		}
	}
	return r.boundedWith(ctx, check, func(tx pgx.Tx) error {
		failpoint.HitContext(ctx, "relay.lease-locked")
		return fn(tx)
	})
}

// wait sleeps for d or until the lease ends.
func (l *lease) wait(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-l.stop:
	case <-l.ctx.Done():
	}
}

// backoff is the wait after a shard's attempt-th failed cycle in a row: exponential from 100ms to
// 10s with jitter.
func backoff(attempt int) time.Duration {
	return retryDelay(100*time.Millisecond, 10*time.Second, attempt, 0)
}

// retryDelay is the wait before trying again after attempts failed attempts: exponential from lo up
// to hi, with jitter so that relays retrying together spread out, and never shorter than
// retryAfter, capped at an hour against nonsense.
func retryDelay(lo, hi time.Duration, attempts int, retryAfter time.Duration) time.Duration {
	ceiling := lo << min(max(attempts-1, 0), 30)
	if ceiling <= 0 || ceiling > hi {
		ceiling = hi
	}
	wait := ceiling/2 + rand.N(ceiling/2+1)
	return max(wait, min(retryAfter, time.Hour))
}
