package relay

import (
	"fmt"
	"log/slog"
	"sync"
)

// outage logs a failure that every shard meets at once when a dependency goes away (Kafka, the
// provider of side-effect calls): once when the first shard meets it and once when the last one
// recovers, rather than once per shard. Each shard tells it of each of its failures (fail) and of
// its recovery or its end (settle). While an outage lasts, err says so, for Ready, with the latest
// failure: the one that says what is wrong now.
type outage struct {
	log     *slog.Logger
	what    string // what fails: "publishing", "executing calls"
	mu      sync.Mutex
	failing map[int]bool
	last    error // the latest failure of any shard
}

func newOutage(log *slog.Logger, what string) *outage {
	return &outage{log: log, what: what, failing: map[int]bool{}}
}

// fail records that shard failed with err.
func (o *outage) fail(shard int, err error) {
	o.mu.Lock()
	first := len(o.failing) == 0
	o.failing[shard] = true
	o.last = err
	o.mu.Unlock()
	if first {
		o.log.Error(o.what+" failed; retrying with backoff", "shard", shard, "error", err)
	} else {
		o.log.Debug(o.what+" failed; retrying with backoff", "shard", shard, "error", err)
	}
}

// settle records that shard no longer fails: it recovered after failures attempts (0 when it
// stops without having recovered: released, or the relay stopping).
func (o *outage) settle(shard, failures int) {
	o.mu.Lock()
	was := o.failing[shard]
	delete(o.failing, shard)
	over := was && len(o.failing) == 0
	if over {
		o.last = nil
	}
	o.mu.Unlock()
	switch {
	case over && failures > 0:
		o.log.Info(o.what+" recovered", "shard", shard, "failed_attempts", failures)
	case over:
		// The outage was logged: its end is too, though this relay did not see it end.
		o.log.Info(o.what+" no longer fails on this relay: its last failing shard was released before it recovered", "shard", shard)
	}
}

// err describes the outage while one lasts: how many shards fail, and the latest failure.
func (o *outage) err() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.failing) == 0 {
		return nil
	}
	return fmt.Errorf("%s fails on %d shard(s): %w", o.what, len(o.failing), o.last)
}
