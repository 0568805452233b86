package relay

import (
	"log/slog"
	"sync"
)

// outage logs a failure that every shard meets at once when a dependency goes away (Kafka, the
// provider of side-effect calls): once when the first shard meets it and once when the last one
// recovers, rather than once per shard. Each shard tells it of its own first failure (fail) and of
// its recovery or its end (settle); retries in between are the shard's business.
type outage struct {
	log                *slog.Logger
	failedMsg, overMsg string
	mu                 sync.Mutex
	failing            map[int]bool
}

func newOutage(log *slog.Logger, failedMsg, overMsg string) *outage {
	return &outage{log: log, failedMsg: failedMsg, overMsg: overMsg, failing: map[int]bool{}}
}

// fail records that shard has started failing with err.
func (o *outage) fail(shard int, err error) {
	o.mu.Lock()
	first := len(o.failing) == 0
	o.failing[shard] = true
	o.mu.Unlock()
	if first {
		o.log.Error(o.failedMsg, "shard", shard, "error", err)
	} else {
		o.log.Debug(o.failedMsg, "shard", shard, "error", err)
	}
}

// settle records that shard no longer fails: it recovered after failures attempts (0 when it
// stops without having recovered, which ends its part in the outage silently).
func (o *outage) settle(shard, failures int) {
	o.mu.Lock()
	was := o.failing[shard]
	delete(o.failing, shard)
	last := was && len(o.failing) == 0
	o.mu.Unlock()
	if last && failures > 0 {
		o.log.Info(o.overMsg, "shard", shard, "failed_attempts", failures)
	}
}
