package relay

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// watch looks for rows to publish on behalf of every shard whose worker is parked (it found its
// slots empty), in one query for all of them, and wakes those whose slots have rows. It looks
// every PollInterval while it finds rows or shards publish, and backs off to IdlePollInterval
// while nothing comes (see fastLooks). A look is a poll of what is pending, like a read, so a row that commits
// late is found by the next look; nothing is missed if a worker parks just after a look, only
// delayed to the next. When a look fails, every parked worker is woken to read for itself, and
// meets the failure and its backoff there.
func (r *Relay) watch(ctx context.Context) {
	wait, empty := r.cfg.PollInterval, 0
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.active:
			empty = 0
			if wait > r.cfg.PollInterval {
				wait = r.cfg.PollInterval
				t.Reset(wait)
			}
			continue
		case <-t.C:
		}
		began := time.Now()
		if r.look(ctx) {
			wait, empty = r.cfg.PollInterval, 0
		} else if empty++; empty > fastLooks {
			wait = min(2*wait, r.cfg.IdlePollInterval)
		}
		// The wait runs from the start of one look to the start of the next: a row that commits
		// while a look runs waits for the next one no longer than if the look had cost nothing.
		// Looks that take more than half of it (a database in trouble) are spaced by their own
		// length instead, so they never keep it busy more than half of the time.
		took := time.Since(began)
		t.Reset(max(wait-took, took))
	}
}

// fastLooks is how many looks in a row may find nothing before watch starts backing off: rows that
// come a few PollIntervals apart are then each found within one PollInterval, not after a wait
// that doubled meanwhile. An idle relay pays for them once, after its last rows.
const fastLooks = 16

// look wakes the parked workers whose slots have rows to publish, and reports whether there were
// any. Every balanceProbeEvery it also asks, in the same query, whether the leases call for a
// balance (a relay joined or left, a lease was released), and asks Run for one: shards a
// stopping relay released are then taken over at once, not at the next renewal.
func (r *Relay) look(ctx context.Context) bool {
	r.mu.Lock()
	parked := map[int]*lease{}
	var slots []int16
	for shard, l := range r.held {
		if l.parked.Load() {
			parked[shard] = l
			slots = append(slots, l.slots...)
		}
	}
	r.mu.Unlock()
	query, args := r.sql.dueSlots, []any{slots}
	if probe := time.Since(r.probedAt) >= balanceProbeEvery; probe {
		query, args = r.sql.dueSlotsOrBalance, []any{slots, r.cfg.Shards, r.liveSeen.Load()}
		r.probedAt = time.Now()
	} else if len(parked) == 0 {
		return false
	}
	var due []int16
	err := r.read(ctx, query, args, func(rows pgx.Rows) (err error) {
		due, err = pgx.CollectRows(rows, pgx.RowTo[int16])
		return err
	})
	if err != nil {
		r.logDB("look for rows", err)
		for _, l := range parked {
			l.wakeUp()
		}
		return false
	}
	dueIn := map[*lease][]int16{}
	for _, s := range due {
		if s < 0 {
			select {
			case r.rebalance <- struct{}{}:
			default:
			}
			continue
		}
		l := parked[int(s)%r.cfg.Shards]
		dueIn[l] = append(dueIn[l], s)
	}
	for l, slots := range dueIn {
		if len(slots) == 1 {
			l.dueSlot.Store(int32(slots[0]))
		} else {
			l.dueSlot.Store(noSlot)
		}
		l.wakeUp()
	}
	return len(dueIn) > 0
}

// noSlot is lease.dueSlot's "no one slot".
const noSlot = -1

// balanceProbeEvery is how often the looks also ask whether the leases call for a balance: a few
// times a second, so that a free lease that cannot be taken right now (its row locked by a frozen
// relay) costs a balance no more often.
const balanceProbeEvery = 250 * time.Millisecond

// park waits until watch finds rows in the shard's slots, or the lease ends. A shard that has just
// published tells watch to look often.
func (l *lease) park(published bool) {
	if published {
		select {
		case l.relay.active <- struct{}{}:
		default:
		}
	}
	l.parked.Store(true)
	defer l.parked.Store(false)
	select {
	case <-l.wake:
	case <-l.stop:
	case <-l.ctx.Done():
	}
}

// wakeUp ends the worker's park, or its next one if it is not parked yet.
func (l *lease) wakeUp() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}
