package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

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
}

// pendingRow is one outbox row read for publishing.
type pendingRow struct {
	id           int64
	topic        string
	partitionKey string
	uuid         string
	payload      []byte
	metadata     string
}

// run publishes the shard's rows until the lease ends. It reports true when the lease was found
// superseded, so the relay drops it.
func (l *lease) run() (fenced bool) {
	r := l.relay
	var pub ShardPublisher
	defer func() {
		if pub != nil {
			_ = pub.Close()
		}
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
			n   int
			err error
		)
		if pub == nil {
			pub, err = l.open()
		}
		if err == nil {
			n, err = l.cycle(pub)
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
			// which fences that one in turn.
			if err := l.fenced(l.ctx, checkOnly); err != nil {
				return l.ctx.Err() == nil
			}
			l.failures++
			r.log.Warn("producer fenced while the lease is still ours; opening a new one", "shard", l.shard, "token", l.token, "error", err)
			l.wait(backoff(l.failures))
		case err != nil && l.ctx.Err() != nil:
			return false
		case err != nil:
			l.failures++
			r.metrics.PublishErrors.Inc()
			if l.failures == 1 {
				r.log.Error("publishing failed; retrying with backoff", "shard", l.shard, "error", err)
			}
			// A failed Kafka transaction can leave the producer unusable; a fresh one is cheap.
			if pub != nil {
				_ = pub.Close()
				pub = nil
			}
			l.wait(backoff(l.failures))
		default:
			if l.failures > 0 {
				r.log.Info("publishing recovered", "shard", l.shard, "failed_attempts", l.failures)
				l.failures = 0
			}
			if n < r.cfg.BatchSize {
				l.wait(r.cfg.PollInterval)
			}
		}
	}
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
	pub, err := l.relay.cfg.Sink.Open(l.ctx, l.shard, l.token)
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

// cycle reads one batch, publishes it and completes it. It returns how many rows it read.
func (l *lease) cycle(pub ShardPublisher) (int, error) {
	r := l.relay
	rows, err := r.cfg.DB.Query(l.ctx, r.sql.readMessages, l.slots, r.cfg.BatchSize)
	if err != nil {
		return 0, fmt.Errorf("relay: read shard %d: %w", l.shard, err)
	}
	batch, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (pendingRow, error) {
		var p pendingRow
		err := row.Scan(&p.id, &p.topic, &p.partitionKey, &p.uuid, &p.payload, &p.metadata)
		return p, err
	})
	if err != nil {
		return 0, fmt.Errorf("relay: read shard %d: %w", l.shard, err)
	}
	if len(batch) == 0 {
		return 0, nil
	}
	failpoint.HitContext(l.ctx, "relay.after-read")

	msgs := make([]Message, len(batch))
	ids := make([]int64, len(batch))
	for i, p := range batch {
		msgs[i] = l.toMessage(p)
		ids[i] = p.id
	}
	spans := l.startPublishSpans(msgs)
	err = pub.Publish(l.ctx, msgs)
	endPublishSpans(spans, msgs, err)
	if err != nil {
		var rejected *RejectedError
		if errors.As(err, &rejected) {
			return len(batch), l.bury(batch, rejected)
		}
		return 0, err
	}
	failpoint.HitContext(l.ctx, "relay.after-publish")

	err = l.fenced(l.ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(l.ctx, r.sql.deleteRows, ids)
		return err
	})
	if err != nil {
		return 0, err
	}
	failpoint.HitContext(l.ctx, "relay.after-complete")
	r.metrics.Published.Add(float64(len(batch)))
	return len(batch), nil
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

// bury moves the rows the broker refused for good to the dead-letter table; the rest of the batch
// is published on the next cycle. Later rows with the same key are not held back: a dead row waits
// for a person, and blocking its key would stop every later message of it too.
func (l *lease) bury(batch []pendingRow, rejected *RejectedError) error {
	r := l.relay
	return l.fenced(l.ctx, func(tx pgx.Tx) error {
		for i, cause := range rejected.Rejected {
			p := batch[i]
			var meta map[string]string
			_ = json.Unmarshal([]byte(p.metadata), &meta)
			if _, err := tx.Exec(l.ctx, r.sql.deleteRows, []int64{p.id}); err != nil {
				return err
			}
			err := r.dead.Add(l.ctx, tx, dlq.Entry{
				Source: dlq.SourceRelay, Topic: p.topic, PartitionKey: p.partitionKey, UUID: p.uuid,
				Payload: p.payload, Metadata: meta, Reason: "rejected by broker", Error: cause.Error(), Attempts: 1,
			})
			if err != nil {
				return err
			}
			r.metrics.DeadLetters.WithLabelValues(string(dlq.SourceRelay), "rejected by broker").Inc()
			r.log.Warn("broker rejected a message for good; moved to the dead-letter table",
				"shard", l.shard, "message_uuid", p.uuid, "error", cause)
		}
		return nil
	})
}

// fenced runs fn in a transaction that first locks the shard's lease row and checks that the token
// is still ours. A bare "WHERE token = mine" on the write is not enough: a takeover could commit
// between that check and the write. Holding the lock, a takeover waits for us instead.
func (l *lease) fenced(ctx context.Context, fn func(pgx.Tx) error) error {
	r := l.relay
	err := pgx.BeginFunc(ctx, r.cfg.DB, func(tx pgx.Tx) error {
		// A relay frozen inside this transaction (a GC pause, SIGSTOP, a VM freeze) would keep the
		// lease row locked for as long as it stays frozen: the next owner's acquire skips locked
		// rows, and a relay starting up waits for the lock, so the shard would stall. PostgreSQL
		// ends the session instead once it has sat idle in the transaction for a lease TTL, when
		// the lease has run out anyway; the frozen relay's write fails when it wakes.
		if _, err := tx.Exec(ctx, setIdleTimeout, strconv.FormatInt(r.cfg.LeaseTTL.Milliseconds(), 10)); err != nil {
			return fmt.Errorf("relay: lock lease of shard %d: %w", l.shard, err)
		}
		var one int
		err := tx.QueryRow(ctx, r.sql.checkLease, l.shard, l.token).Scan(&one)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: shard %d token %d superseded in the database", ErrFenced, l.shard, l.token)
		}
		if err != nil {
			return fmt.Errorf("relay: lock lease of shard %d: %w", l.shard, err)
		}
		failpoint.HitContext(ctx, "relay.lease-locked")
		return fn(tx)
	})
	return err
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

// backoff is exponential from 100ms to 10s with full jitter, so relays retrying together spread out.
func backoff(attempt int) time.Duration {
	ceiling := 100 * time.Millisecond << min(attempt-1, 7)
	ceiling = min(ceiling, 10*time.Second)
	return ceiling/2 + rand.N(ceiling/2+1)
}
