package inbox

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/internal/sqlname"
)

// DefaultStatsInterval is Config.StatsInterval when it is not specified.
const DefaultStatsInterval = 5 * time.Second

// dedupCounts are the checks and hits of one handler not yet written.
type dedupCounts struct{ checks, hits int64 }

// statsBuffer aggregates the dedup counts in memory and writes them to txbox_dedup_stats at most
// every interval, so that the hit rate outlives the process at the cost of one statement per
// interval, not one per message. A message that finds the interval passed starts the write in the
// background and does not wait for it; one that comes sooner, or while a write runs, arms a timer
// for when the next write is due, so the counts of a consumer that then goes quiet are written too;
// Flush writes synchronously.
type statsBuffer struct {
	interval time.Duration // 0: the counts are not written

	mu       sync.Mutex
	pending  map[string]dedupCounts // by handler
	due      time.Time              // the earliest time the next background write may start
	writing  chan struct{}          // closed when the background write in progress ends; nil if none
	timer    *time.Timer            // armed to write pending counts once due; nil if not armed
	failing  streak                 // of failed writes
	flushSQL string
}

// add counts one check (and a hit) of handler.
func (s *statsBuffer) add(handler string, checks, hits int64) {
	if s.interval == 0 {
		return
	}
	s.mu.Lock()
	c := s.pending[handler]
	c.checks += checks
	c.hits += hits
	s.pending[handler] = c
	s.mu.Unlock()
}

// take removes and returns the pending counts.
func (s *statsBuffer) take() map[string]dedupCounts {
	p := s.pending
	s.pending = make(map[string]dedupCounts, len(p))
	return p
}

// putBack returns counts that could not be written, to be written with the next ones.
func (s *statsBuffer) putBack(p map[string]dedupCounts) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for h, c := range p {
		cur := s.pending[h]
		cur.checks += c.checks
		cur.hits += c.hits
		s.pending[h] = cur
	}
}

// maybeFlush starts a background write when counts are pending, the interval has passed and none
// is in progress; while it has not, it makes sure a timer comes back when it has. The timer's
// write (quiet) reports a failure at debug level only: it may come after the application closed
// the database and stopped caring, and the next message's write reports it anyway.
func (ib *Inbox) maybeFlush(quiet bool) {
	s := &ib.stats
	if s.interval == 0 {
		return
	}
	s.mu.Lock()
	if len(s.pending) == 0 {
		s.mu.Unlock()
		return
	}
	if s.writing != nil || time.Now().Before(s.due) {
		if s.timer == nil {
			s.timer = time.AfterFunc(max(time.Until(s.due), minStatsWait), func() {
				s.mu.Lock()
				s.timer = nil
				s.mu.Unlock()
				ib.maybeFlush(true)
			})
		}
		s.mu.Unlock()
		return
	}
	s.due = time.Now().Add(s.interval)
	p := s.take()
	done := make(chan struct{})
	s.writing = done
	s.mu.Unlock()
	go func() {
		defer close(done)
		ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
		defer cancel()
		err := ib.writeStats(ctx, p)
		if quiet && err != nil {
			ib.logger.Debug("Could not write the dedup counts of a quiet consumer; they are kept for the next message or Flush",
				watermill.LogFields{"error": err.Error()})
		} else {
			ib.reportStatsWrite(err)
		}
		s.mu.Lock()
		s.writing = nil
		s.mu.Unlock()
	}()
}

// minStatsWait spaces the stats timer's returns while a write that outlasted its interval is still
// in progress.
const minStatsWait = 100 * time.Millisecond

// Flush writes the dedup counts not yet written to txbox_dedup_stats, after any write in progress.
// Counts are otherwise written at most every Config.StatsInterval, in the background: call Flush
// once the router has stopped to keep the last interval's counts. Counts that cannot be written stay
// pending.
func (ib *Inbox) Flush(ctx context.Context) error {
	s := &ib.stats
	if s.interval == 0 {
		return nil
	}
	s.mu.Lock()
	inProgress := s.writing
	s.mu.Unlock()
	if inProgress != nil {
		select {
		case <-inProgress:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	s.mu.Lock()
	p := s.take()
	s.mu.Unlock()
	err := ib.writeStats(ctx, p)
	ib.reportStatsWrite(err)
	return err
}

// writeStats adds p to the current minute's buckets. On failure the counts go back to pending.
func (ib *Inbox) writeStats(ctx context.Context, p map[string]dedupCounts) error {
	if len(p) == 0 {
		return nil
	}
	// Sorted, so that two instances of a consumer writing at once lock the buckets in one order.
	handlers := slices.Sorted(func(yield func(string) bool) {
		for h := range p {
			if !yield(h) {
				return
			}
		}
	})
	checks := make([]int64, len(handlers))
	hits := make([]int64, len(handlers))
	for i, h := range handlers {
		checks[i], hits[i] = p[h].checks, p[h].hits
	}
	if _, err := ib.cfg.DB.Exec(ctx, ib.stats.flushSQL, ib.cfg.Consumer, handlers, checks, hits); err != nil {
		ib.stats.putBack(p)
		return fmt.Errorf("inbox: write dedup stats: %w", err)
	}
	return nil
}

func (ib *Inbox) reportStatsWrite(err error) {
	switch first, recovered := ib.stats.failing.report(err); {
	case first:
		ib.logger.Error("Could not write the dedup counts; they are kept and written later", err, nil)
	case recovered:
		ib.logger.Info("Writing the dedup counts again", nil)
	}
}

// DedupStat is the dedup checks and hits of one consumer's handler over a window, from
// txbox_dedup_stats.
type DedupStat struct {
	Consumer string `json:"consumer"`
	// Handler is the router handler; "" for an inbox used outside a router.
	Handler string `json:"handler"`
	Checks  int64  `json:"checks"`
	Hits    int64  `json:"hits"`
	// HitRate is Hits / Checks: about 0 in steady state.
	HitRate float64 `json:"hit_rate"`
	// Since is the start of the oldest minute counted.
	Since time.Time `json:"since"`
	// Updated is when counts were last added: figures of the last StatsInterval (and of a consumer
	// that stopped without Flush) are not in yet.
	Updated time.Time `json:"updated"`
}

// Querier is what DedupStats needs from PostgreSQL; *pgxpool.Pool satisfies it.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// DedupStats returns the dedup counts per consumer and handler of the minutes that overlap the
// last window (by the database clock), ordered by consumer and handler. Only inboxes that write
// their counts (Config.StatsInterval not negative) appear.
func DedupStats(ctx context.Context, db Querier, schema string, window time.Duration) ([]DedupStat, error) {
	quoted, err := sqlname.Schema(schema)
	if err != nil {
		return nil, fmt.Errorf("inbox: %w", err)
	}
	if window <= 0 {
		return nil, fmt.Errorf("inbox: dedup stats window must be positive, got %s", window)
	}
	rows, err := db.Query(ctx, sqlname.Render(dedupStatsSQL, quoted), window.Milliseconds())
	if err != nil {
		return nil, fmt.Errorf("inbox: read dedup stats: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (DedupStat, error) {
		var s DedupStat
		err := row.Scan(&s.Consumer, &s.Handler, &s.Checks, &s.Hits, &s.Since, &s.Updated)
		if s.Checks > 0 {
			s.HitRate = float64(s.Hits) / float64(s.Checks)
		}
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("inbox: read dedup stats: %w", err)
	}
	return out, nil
}
