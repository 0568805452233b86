package relay_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/relay"
)

// TestGracefulStopWhileKafkaHangs makes Kafka stop answering what producers send (requests are
// read and left waiting, as a broker stuck waiting for its replicas does) while the relay
// publishes, then stops
// the relay. sarama's calls cannot be cancelled and wait for their read timeouts (30 s by default),
// but Run must return within one lease TTL, plus a margin for the database work of giving the
// leases up. Once Kafka answers again, a new relay publishes every row: nothing was lost.
func TestGracefulStopWhileKafkaHangs(t *testing.T) {
	t.Parallel()
	for _, transactional := range []bool{true, false} {
		t.Run(map[bool]string{true: "transactional", false: "idempotent"}[transactional], func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			cluster := strictCluster(t, kfake.SeedTopics(3, b.topic))
			// While hung, requests wait in the broker (and sarama waits for its read timeouts, 30 s);
			// once released they are answered, so that the relay's abandoned calls end cleanly.
			var hung atomic.Bool
			var unanswered atomic.Int64
			release := make(chan struct{})
			t.Cleanup(func() { hung.Store(false); closeOnce(release) })
			cluster.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
				cluster.KeepControl()
				switch kmsg.Key(req.Key()) {
				case kmsg.Produce, kmsg.InitProducerID, kmsg.AddPartitionsToTxn, kmsg.EndTxn:
				default:
					return nil, nil, false // readers and metadata keep working
				}
				if hung.Load() {
					unanswered.Add(1)
					cluster.SleepControl(func() { <-release })
				}
				return nil, nil, false
			})
			log := readTopics(t, cluster.ListenAddrs(), b.topic)

			first := b.write(t, true, "k", 5)
			var logs proctest.Buffer
			ttl := 2 * time.Second
			_, stop := b.runRelayOn(t, b.kafkaSink(t, cluster.ListenAddrs(), transactional), &logs, nil)
			require.Eventually(t, func() bool { return log.has(first...) && b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)

			hung.Store(true)
			second := b.write(t, true, "k", 5)
			require.Eventually(t, func() bool { return unanswered.Load() > 0 }, 30*time.Second, 5*time.Millisecond,
				"the relay is waiting for Kafka")
			took := stop()
			t.Logf("Run returned %v after the stop", took.Round(time.Millisecond))
			require.Less(t, took, ttl*3/2, "a graceful stop ends within one lease TTL, whatever Kafka does")
			require.Equal(t, len(second), b.pending(t), "nothing was completed without Kafka")

			hung.Store(false)
			closeOnce(release)
			b.runRelayOn(t, b.kafkaSink(t, cluster.ListenAddrs(), transactional), &logs, nil)
			require.Eventually(t, func() bool { return log.has(second...) && b.pending(t) == 0 }, 60*time.Second, 10*time.Millisecond,
				"the rows left behind were published after the stop")
		})
	}
}

var closeMu sync.Mutex

// closeOnce closes ch unless it is closed already.
func closeOnce(ch chan struct{}) {
	closeMu.Lock()
	defer closeMu.Unlock()
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// TestStopWhileStarting stops a relay that cannot start yet, because another session holds the
// lease table's layout lock: Run retries its bounded waits until the stop, then returns nil, as a
// stop at any other time does, holding nothing. (A process manager stopping a relay that is still
// starting must not see it fail.)
func TestStopWhileStarting(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	blocker, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = blocker.Rollback(ctx) })
	_, err = blocker.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1 || '.txbox_lease', 0))`, pgx.Identifier{b.env.Schema}.Sanitize())
	require.NoError(t, err)

	var logs proctest.Buffer
	r, stop := b.runRelayOn(t, b.kafkaSink(t, kafkatest.Brokers(t), true), &logs, nil)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "preparing the lease table timed out; retrying") },
		30*time.Second, 10*time.Millisecond, "the relay waits for the layout lock")
	stop()
	require.Contains(t, logs.String(), "relay stopped before it started")
	require.Empty(t, r.Shards())
}

// A second Run of a Relay while its first runs is refused: it shared the first's leases under one
// owner, released them all when it stopped, and left the first reporting itself not running, for
// good, while it published.
func TestASecondConcurrentRunOfARelayIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	r := b.startRelay(t, nil)
	require.Eventually(t, func() bool { return r.Ready() == nil && len(r.Shards()) == 4 }, 30*time.Second, 10*time.Millisecond, "%v", r.Ready())
	held := r.Shards()
	require.ErrorIs(t, r.Run(context.Background()), relay.ErrAlreadyRunning)
	require.NoError(t, r.Ready())
	require.Equal(t, held, r.Shards(), "the first Run's leases, untouched")
	c := b.collect(t)
	ids := b.write(t, true, "after", 3)
	require.Eventually(t, func() bool { return c.has(ids...) }, 30*time.Second, 10*time.Millisecond)
}
