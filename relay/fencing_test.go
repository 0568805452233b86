package relay_test

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/url"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// Tests of fencing (DESIGN.md, "Fencing, precisely"): a relay that lost its lease — paused past it,
// or overtaken between its token check and its write — changes no row in PostgreSQL, its Kafka
// transaction is fenced, and consumers process every message once, in key order.

// TestZombieRelayIsFenced pauses relay A (a real process) at a point of its work under load, lets
// relay B take its shard over and publish, then wakes A up.
//
// Each case stops A with a "stop" failpoint (SIGSTOP from inside, so the point is exact) where a
// GC pause or a VM freeze could catch it:
//   - inside its Kafka transaction: the records are sent, the commit is not. B's producer
//     initialisation must fence A's and abort that transaction: a read_uncommitted reader sees A's
//     records, no read_committed reader ever does, and A's commit fails when it wakes.
//   - between publishing and completing a batch (Kafka committed): A wakes with the batch in hand
//     and must not delete its rows.
//   - inside the completion transaction, holding the lease row lock: PostgreSQL must end A's
//     session (the relay sets idle_in_transaction_session_timeout to a third of the lease TTL on fenced
//     transactions), or B could never take the shard, and A's write must not land when it wakes.
//     (@4: the checks before and after opening the producer are the first two hits.)
//   - between checking its lease and opening its producer: when A wakes, opening its producer
//     fences B's. A must find its lease gone before publishing anything, and B, whose lease is
//     still valid, must open a new producer instead of giving the shard up.
//   - with an idempotent, non-transactional producer (--transactional=false, the documented
//     weaker mode), after reading a batch: nothing fences A in Kafka, so when it wakes it
//     publishes copies of rows B already published and completed. They must arrive as duplicates
//     the inbox drops, each counted by txbox_superseded_token_messages_total.
//
// In the two "published" cases B stops itself after publishing its first batch, with a lease long enough
// to outlast the test's checks: the rows A has in hand are then still pending when A wakes, so
// "A deleted none of them" is an observation, not a foregone conclusion (had B already completed
// them, A's stale DELETE would match no row whether fenced or not).
//
// In every case a trigger records, for each outbox row deleted, the deleting process and the lease
// row as the deleting transaction saw it: a delete by A under a lease that is no longer A's is the
// stale write the fence exists to stop.
func TestZombieRelayIsFenced(t *testing.T) {
	t.Parallel()
	const (
		nothing   = iota // A stops before it could publish anything
		openTxn          // A stops with records sent in a Kafka transaction it has not committed
		published        // A stops with a batch published (Kafka committed) but not completed
		read             // A stops with a batch read but not published, and has no transactions
	)
	for _, tc := range []struct {
		name  string
		stopA string // A's failpoints
		stopB string // B's failpoints; when set, B runs with a long lease
		holds int    // what A holds when it stops
	}{
		{name: "inside its Kafka transaction", stopA: "kafka.before-commit=stop@3", holds: openTxn},
		{name: "between publish and completion", stopA: "relay.after-publish=stop@3", stopB: "relay.after-publish=stop@1", holds: published},
		{name: "holding the lease row lock", stopA: "relay.lease-locked=stop@4", stopB: "relay.after-publish=stop@1", holds: published},
		{name: "between its lease check and opening its producer", stopA: "relay.before-open=stop@1", holds: nothing},
		{name: "without Kafka transactions, with a batch read", stopA: "relay.after-read=stop@3", holds: read},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			b.auditDeletes(t)
			committed := b.record(t, sarama.ReadCommitted)
			uncommitted := b.record(t, sarama.ReadUncommitted)
			cons := b.startConsumer(t)
			// A lease TTL of 2 s rather than the harness's 1 s: a transaction left idle for a third of
			// it is ended, and on a starved test machine 333 ms between two statements of B's renewal
			// was seen, which cost B the lease it must keep to the end.
			args := []string{"--shards", "1", "--lease-ttl", "2s"}
			if tc.holds == read {
				args = append(args, "--transactional=false")
			}
			a := b.startRelayProc(t, "A", tc.stopA, args...)
			prod := b.produce(t, 6, 10*time.Millisecond)
			require.Eventually(t, func() bool { return strings.Contains(a.Output(), "txbox failpoint:") }, 60*time.Second, 10*time.Millisecond,
				"A reached its failpoint under load")
			owner, tokenA := b.leaseOf(t, 0)
			require.Equal(t, "A", owner)
			t.Logf("A stopped holding shard 0 under token %d", tokenA)

			// The lease runs out by the database's clock while A is stopped.
			require.Eventually(t, func() bool { return b.leaseExpired(t, 0) }, 10*time.Second, 10*time.Millisecond)

			var inHand []string
			if tc.holds == published {
				// A's batch in hand: rows it made visible in Kafka under its token but did not delete.
				require.Eventually(t, func() bool {
					inHand = b.pendingAmong(t, committed.withToken(tokenA))
					return len(inHand) > 0
				}, 30*time.Second, 10*time.Millisecond, "A's published batch reached the consumer and is still pending")
			}

			var bArgs []string
			if tc.stopB != "" {
				bArgs = []string{"--lease-ttl", "30s"}
			}
			bp := b.startRelayProc(t, "B", tc.stopB, append(args, bArgs...)...)
			var tokenB int64
			require.Eventually(t, func() bool {
				owner, tokenB = b.leaseOf(t, 0)
				return owner == "B"
			}, 20*time.Second, 10*time.Millisecond, "B took the shard over while A was stopped")
			require.Greater(t, tokenB, tokenA)
			require.Eventually(t, func() bool { return len(committed.withToken(tokenB)) > 0 }, 30*time.Second, 10*time.Millisecond,
				"B published under its token")
			if tc.stopB != "" {
				require.Eventually(t, func() bool { return strings.Contains(bp.Output(), "txbox failpoint:") }, 30*time.Second, 10*time.Millisecond)
				require.Subset(t, b.pendingAmong(t, inHand), inHand, "B stopped before completing A's batch")
			}

			a.Signal(syscall.SIGCONT)
			require.Eventually(t, func() bool { return droppedShard(a.Output(), 0, tokenA) }, 30*time.Second, 10*time.Millisecond,
				"A gave the shard up when it woke")
			if tc.stopB != "" {
				// B is stopped and holds the lease: nothing but A could have deleted these rows.
				require.ElementsMatch(t, inHand, b.pendingAmong(t, inHand), "A's stale completion deleted no row")
				bp.Signal(syscall.SIGCONT)
			}
			order := prod.stop(t)
			b.requireProcessedOnceInOrder(t, order)
			// Every key got a message after A woke; once they are in, both readers have seen all
			// that A could ever have made visible on every partition that carries our keys.
			require.Eventually(t, func() bool { return committed.has(prod.last()...) && uncommitted.has(prod.last()...) },
				30*time.Second, 10*time.Millisecond)

			b.requireNoStaleDeletes(t)
			fromA := committed.withToken(tokenA)
			late := committed.arrivedAfter(tokenB, tokenA)
			copies := late
			if tc.holds == read {
				// Without Kafka transactions nothing holds A's late copies back: one can arrive even
				// before B's copy of the same row. A copy is then any row B published too.
				copies = intersect(fromA, committed.withToken(tokenB))
			}
			require.Subset(t, slices.Concat(b.deletedUnder(t, "A", tokenA), inHand, copies), slices.Collect(maps.Keys(fromA)),
				"every message A made visible is a row it completed under its lease, the batch it held, or a late copy")
			superseded := gathered(t, cons, "txbox_superseded_token_messages_total")
			owner, token := b.leaseOf(t, 0)
			require.Equal(t, "B", owner)
			require.Equal(t, tokenB, token, "B kept the shard to the end")
			require.False(t, droppedShard(bp.Output(), 0, tokenB), "B never gave its lease up")
			switch tc.holds {
			case nothing:
				require.Empty(t, fromA, "A published nothing: it found its lease gone once its producer was open")
				require.Contains(t, bp.Output(), "producer fenced while the lease is still ours; opening a new one",
					"A's late producer initialisation fenced B's producer, and B opened a new one")
			case openTxn:
				aborted := without(uncommitted.withToken(tokenA), fromA)
				require.NotEmpty(t, aborted, "A had records in its open transaction when it stopped")
				t.Logf("A's fenced transaction held %d message(s); read_committed readers saw none of them", len(aborted))
				inboxTokens := b.inboxTokens(t)
				for _, u := range aborted {
					require.Equal(t, []int64{tokenB}, committed.tokensOf(u), "message %s reached read_committed readers only from B", u)
					require.Equal(t, tokenB, inboxTokens[u], "the inbox recorded B's lease for %s", u)
				}
				require.Empty(t, intersect(fromA, committed.withToken(tokenB)))
			case published:
				require.ElementsMatch(t, inHand, intersect(fromA, committed.withToken(tokenB)),
					"the only messages both relays published are the batch A held; B republished it")
			case read:
				require.NotEmpty(t, copies, "A published its stale batch when it woke: nothing fenced it in Kafka")
				require.Empty(t, intersect(toSet(copies), toSet(b.deletedUnder(t, "A", tokenA))), "A completed none of the rows it copied late")
				inboxTokens := b.inboxTokens(t)
				for _, u := range late {
					require.Equal(t, tokenB, inboxTokens[u], "the inbox processed B's copy of %s and dropped A's, which came later", u)
				}
				require.GreaterOrEqual(t, superseded, float64(len(late)), "every late copy from A was counted as coming from a superseded token")
			}
			if tc.holds != read {
				require.Empty(t, late, "no copy from A arrived after B's: the broker fenced A")
				require.Zero(t, superseded)
			}
			t.Logf("the inbox dropped %v duplicate(s); %v message(s) came with a superseded token",
				gathered(t, cons, "txbox_dedup_hits_total"), superseded)
		})
	}
}

// TestTakeoverRace makes a takeover of relay A's shard commit at each point of A's work,
// deterministically: an in-process hook (failpoint.WithHook) holds A at the point while the test
// changes the lease's token, as a relay taking the shard over does, then lets A go on.
//
// The takeover here does not wait for A's lease to expire (its own renewals are 10 s apart and it
// is not paused): it is the worst case, a new token committed at the least convenient moment. A
// relay taking over for real also needs the lease expired by the database's clock; see
// TestZombieRelayIsFenced and TestLeaseClock for that.
func TestTakeoverRace(t *testing.T) {
	t.Parallel()

	// Between the token check and the write: A's completion transaction has locked the lease row
	// and checked its token, and holds the batch's DELETE. If the check did not keep the row
	// locked until the write (a bare SELECT, or a check in a transaction of its own), the
	// takeover would commit at once and the DELETE would then land under the new owner's lease.
	// It must wait for A instead, and A's write lands under the token A checked.
	t.Run("between the token check and the write", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.auditDeletes(t)
		// Hold the lease-locked point of the completion (not of the check before opening the
		// producer): both hooks run on A's worker goroutine, one after the other.
		var published bool
		g := newGate()
		ctx := failpoint.WithHook(context.Background(), "relay.after-publish", func() { published = true })
		ctx = failpoint.WithHook(ctx, "relay.lease-locked", func() {
			if published {
				g.hold()
			}
		})
		r := b.runRelayIn(t, ctx, "A")
		t.Cleanup(g.open)
		uuids := b.write(t, true, "k", 5)
		g.wait(t, "A checked its token before deleting the batch it published")
		tokenA := r.Shards()[0]

		conn, err := b.env.Pool.Acquire(context.Background())
		require.NoError(t, err)
		defer conn.Release()
		var pid int
		require.NoError(t, conn.QueryRow(context.Background(), "SELECT pg_backend_pid()").Scan(&pid))
		type result struct {
			token int64
			err   error
		}
		taken := make(chan result, 1)
		go func() {
			tok, err := b.takeOver(conn.Conn(), 0)
			taken <- result{tok, err}
		}()
		var first bool
		require.Eventually(t, func() bool {
			select {
			case res := <-taken:
				taken <- res
				first = true
				return true
			default:
			}
			var blocked bool
			require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT cardinality(pg_blocking_pids($1)) > 0", pid).Scan(&blocked))
			return blocked
		}, 10*time.Second, 5*time.Millisecond)
		require.False(t, first, "the takeover committed between A's token check and its write")

		g.open()
		var tokenB int64
		select {
		case res := <-taken:
			require.NoError(t, res.err)
			tokenB = res.token
		case <-time.After(30 * time.Second):
			t.Fatal("the takeover never committed")
		}
		require.Greater(t, tokenB, tokenA)
		rows, err := b.env.Pool.Query(context.Background(),
			"SELECT uuid FROM "+b.env.Q("deleted")+" WHERE lease_owner = 'A' AND lease_token = $1", tokenA)
		require.NoError(t, err)
		deleted, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.ElementsMatch(t, uuids, deleted, "A's write landed, under the token it had checked, before the takeover")

		// A learns of the takeover at its next fenced write, and gives the shard up.
		more := b.write(t, true, "k", 1)
		require.Eventually(t, func() bool { return len(r.Shards()) == 0 }, 20*time.Second, 10*time.Millisecond, "A dropped the shard")
		require.Equal(t, more, b.pendingAmong(t, more), "A completed nothing after the takeover")
		b.requireNoStaleDeletes(t)
	})

	// Before the write's check: A published a batch and is on its way to complete it when the
	// takeover commits. Its completion must find the token superseded and change no row.
	t.Run("before the write", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		b.auditDeletes(t)
		g := newGate()
		r := b.runRelayIn(t, failpoint.WithHook(context.Background(), "relay.after-publish", g.hold), "A")
		t.Cleanup(g.open)
		uuids := b.write(t, true, "k", 5)
		g.wait(t, "A published the batch")
		tokenA := r.Shards()[0]
		tokenB, err := b.takeOver(b.env.Pool, 0)
		require.NoError(t, err)
		require.Greater(t, tokenB, tokenA)

		g.open()
		require.Eventually(t, func() bool { return len(r.Shards()) == 0 }, 20*time.Second, 10*time.Millisecond, "A dropped the shard")
		require.ElementsMatch(t, uuids, b.pendingAmong(t, uuids), "A's stale completion deleted no row")
		var deletes int
		require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.env.Q("deleted")).Scan(&deletes))
		require.Zero(t, deletes)
	})

	// Between the lease check and opening the Kafka producer: opening fences whoever holds the
	// shard's transactional.id, so a relay that lost its lease meanwhile would fence the new
	// owner and then publish under its stale token with a producer the broker now accepts. It
	// must check its lease again once the producer is open and publish nothing.
	t.Run("between the lease check and opening the producer", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		g := newGate()
		r := b.runRelayIn(t, failpoint.WithHook(context.Background(), "relay.before-open", g.hold), "A")
		t.Cleanup(g.open)
		g.wait(t, "A checked its lease before opening its producer")
		tokenA := r.Shards()[0]
		uuids := b.write(t, true, "k", 5)
		tokenB, err := b.takeOver(b.env.Pool, 0)
		require.NoError(t, err)
		require.Greater(t, tokenB, tokenA)

		g.open()
		require.Eventually(t, func() bool { return len(r.Shards()) == 0 }, 20*time.Second, 10*time.Millisecond, "A dropped the shard")
		require.ElementsMatch(t, uuids, b.pendingAmong(t, uuids))
		// A's worker has ended (dropping waits for it), and nothing else publishes to the topic: an
		// empty topic means A sent nothing, not even records it then aborted.
		require.Zero(t, b.topicRecords(t), "A wrote nothing to Kafka")
	})
}

// gate holds a relay at a failpoint: the first call of hold blocks until open.
type gate struct {
	held, release chan struct{}
	heldOnce      sync.Once
	openOnce      sync.Once
}

func newGate() *gate { return &gate{held: make(chan struct{}), release: make(chan struct{})} }

func (g *gate) hold() {
	g.heldOnce.Do(func() {
		close(g.held)
		<-g.release
	})
}

func (g *gate) wait(t *testing.T, what string) {
	t.Helper()
	select {
	case <-g.held:
	case <-time.After(30 * time.Second):
		t.Fatalf("never reached: %s", what)
	}
}

func (g *gate) open() { g.openOnce.Do(func() { close(g.release) }) }

// runRelayIn runs an in-process relay with one shard as owner under ctx (which carries the test's
// failpoint hooks) until the test ends. Its lease lasts 30 s, so its renewals stay out of the way.
func (b *bundle) runRelayIn(t *testing.T, ctx context.Context, owner string) *relay.Relay {
	t.Helper()
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t), TransactionalIDPrefix: b.env.Schema})
	require.NoError(t, err)
	r, err := relay.New(relay.Config{
		DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Owner: owner,
		Shards: 1, LeaseTTL: 30 * time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	require.NoError(t, err)
	runUntilCleanup(t, ctx, r)
	require.Eventually(t, func() bool { return len(r.Shards()) == 1 }, 10*time.Second, 5*time.Millisecond, "%s took the shard", owner)
	return r
}

// takeOver gives shard's lease to "B" under a new token, as a relay taking it over would, but
// without waiting for it to expire; the lease then lasts a minute.
func (b *bundle) takeOver(db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, shard int,
) (int64, error) {
	var token int64
	err := db.QueryRow(context.Background(), `UPDATE `+b.env.Q("txbox_lease")+` SET owner = 'B',
		token = nextval('`+b.env.Q("txbox_lease_token")+`'), expires_at = now() + interval '1 minute'
		WHERE shard = $1 RETURNING token`, shard).Scan(&token)
	return token, err
}

// topicRecords returns how many records the bundle's topic holds, committed or not.
func (b *bundle) topicRecords(t *testing.T) int64 {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	client, err := sarama.NewClient(kafkatest.Brokers(t), cfg)
	require.NoError(t, err)
	defer client.Close()
	partitions, err := client.Partitions(b.topic)
	require.NoError(t, err)
	var n int64
	for _, p := range partitions {
		newest, err := client.GetOffset(b.topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		n += newest
	}
	return n
}

// --- helpers shared by fencing_test.go and scale_test.go ---

// delivery is one message as a Kafka reader received it.
type delivery struct {
	uuid, key string
	token     int64
}

// deliveryLog reads the bundle's topic in a consumer group of its own and keeps every delivery.
type deliveryLog struct {
	mu  sync.Mutex
	all []delivery
}

func (b *bundle) record(t *testing.T, isolation sarama.IsolationLevel) *deliveryLog {
	t.Helper()
	cfg := kafkatest.SubscriberConfig(kafkatest.Brokers(t), "log-"+watermill.NewShortUUID())
	cfg.OverwriteSaramaConfig.Consumer.IsolationLevel = isolation
	sub, err := kafka.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := sub.Subscribe(ctx, b.topic)
	require.NoError(t, err)
	l := &deliveryLog{}
	go func() {
		for m := range ch {
			var token int64
			_, _ = fmt.Sscan(m.Metadata.Get(outbox.TokenMetadata), &token)
			l.mu.Lock()
			l.all = append(l.all, delivery{uuid: m.UUID, key: m.Metadata.Get(outbox.PartitionKeyMetadata), token: token})
			l.mu.Unlock()
			m.Ack()
		}
	}()
	return l
}

// withToken returns the UUIDs delivered under token.
func (l *deliveryLog) withToken(token int64) map[string]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]bool{}
	for _, d := range l.all {
		if d.token == token {
			out[d.uuid] = true
		}
	}
	return out
}

// tokensOf returns the distinct tokens uuid was delivered under, in arrival order.
func (l *deliveryLog) tokensOf(uuid string) []int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []int64
	for _, d := range l.all {
		if d.uuid == uuid && !slices.Contains(out, d.token) {
			out = append(out, d.token)
		}
	}
	return out
}

// arrivedAfter returns the UUIDs delivered under token after a delivery of them under newer.
func (l *deliveryLog) arrivedAfter(newer, token int64) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	seen := map[string]bool{}
	var out []string
	for _, d := range l.all {
		switch {
		case d.token == newer:
			seen[d.uuid] = true
		case d.token == token && seen[d.uuid] && !slices.Contains(out, d.uuid):
			out = append(out, d.uuid)
		}
	}
	return out
}

func (l *deliveryLog) has(uuids ...string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	seen := make(map[string]bool, len(l.all))
	for _, d := range l.all {
		seen[d.uuid] = true
	}
	for _, u := range uuids {
		if !seen[u] {
			return false
		}
	}
	return true
}

func without(a, b map[string]bool) []string {
	var out []string
	for u := range a {
		if !b[u] {
			out = append(out, u)
		}
	}
	return out
}

func intersect(a, b map[string]bool) []string {
	out := []string{}
	for u := range a {
		if b[u] {
			out = append(out, u)
		}
	}
	return out
}

// loadProducer writes keyed messages into the outbox, one transaction after the other, until
// stopped: each key's messages are committed in order, so they must be processed in that order.
type loadProducer struct {
	b      *bundle
	keys   []string
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	order  map[string][]string // key → UUIDs in commit order
	final  []string            // the marker written per key by stop
	errors []error
}

// produce starts writing transactions of 1-3 messages on one of keys random keys, one transaction
// every interval.
func (b *bundle) produce(t *testing.T, keys int, every time.Duration) *loadProducer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	p := &loadProducer{b: b, cancel: cancel, done: make(chan struct{}), order: map[string][]string{}}
	for i := range keys {
		p.keys = append(p.keys, fmt.Sprintf("key-%d", i))
	}
	t.Cleanup(func() { cancel(); <-p.done })
	go func() {
		defer close(p.done)
		tick := time.NewTicker(every) // pacing: the load's rate, not a wait for a condition
		defer tick.Stop()
		for {
			// Not cancelled by stop: a commit interrupted by a cancellation may still have
			// committed, and then its messages must be accounted for.
			if err := p.write(context.Background(), p.keys[rand.IntN(len(p.keys))], 1+rand.IntN(3)); err != nil {
				p.mu.Lock()
				p.errors = append(p.errors, err)
				p.mu.Unlock()
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return p
}

func (p *loadProducer) write(ctx context.Context, key string, n int) error {
	tx, err := p.b.env.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // A no-op after Commit.
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), []byte(`{"n":1}`)), key)
	}
	if err := p.b.writer.Publish(ctx, tx, p.b.topic, msgs...); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.order[key] = append(p.order[key], m.UUID)
	}
	return nil
}

// written returns how many messages were committed so far.
func (p *loadProducer) written() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, u := range p.order {
		n += len(u)
	}
	return n
}

// stop ends the load, writes one last message per key (so every key's stream has a message from
// after everything the test did) and returns each key's messages in commit order.
func (p *loadProducer) stop(t *testing.T) map[string][]string {
	t.Helper()
	p.cancel()
	<-p.done
	require.Empty(t, p.errors, "the producer failed")
	for _, k := range p.keys {
		require.NoError(t, p.write(context.Background(), k, 1))
		p.final = append(p.final, p.order[k][len(p.order[k])-1])
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.order)
}

// last returns the messages stop wrote last, one per key.
func (p *loadProducer) last() []string { return p.final }

// requireProcessedOnceInOrder waits until the consumer applied every message's business effect,
// then checks that each was applied exactly once and each key's in commit order.
func (b *bundle) requireProcessedOnceInOrder(t *testing.T, order map[string][]string) {
	t.Helper()
	var all []string
	for _, u := range order {
		all = append(all, u...)
	}
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 90*time.Second, 20*time.Millisecond, "the relays drained the outbox")
	require.Eventually(t, func() bool { return b.allAppliedOnce(t, all) }, 90*time.Second, 20*time.Millisecond,
		"every message was processed")
	applied, processed := b.effects(t)
	lost, twice := 0, 0
	for _, u := range all {
		switch {
		case applied[u] == 0:
			lost++
		case applied[u] > 1:
			twice++
		}
	}
	require.Zero(t, lost, "messages lost")
	require.Zero(t, twice, "messages processed twice")
	require.Equal(t, len(all), len(applied), "no effect of a message nobody wrote")
	for k, want := range order {
		require.Equal(t, want, processed[k], "processing order of %s", k)
	}
	t.Logf("%d messages on %d keys: none lost, none processed twice, every key in order", len(all), len(order))
}

// startRelayProc runs `txbox relay` as owner, with failpoints armed (if not empty), connecting to
// PostgreSQL as application "relay-<owner>" so the audit triggers can tell relays apart.
func (b *bundle) startRelayProc(t *testing.T, owner, failpoints string, extra ...string) *proctest.Proc {
	t.Helper()
	var env []string
	if failpoints != "" {
		env = []string{failpoint.EnvVar + "=" + failpoints}
	}
	args := append([]string{"--owner", owner, "--database-url", b.relayDSN(t, owner)}, extra...)
	return proctest.Start(t, env, b.relayArgs(t, args...)...)
}

// relayDSN is the test database's connection string for owner's relay, with more run-time
// parameters as key, value pairs.
func (b *bundle) relayDSN(t *testing.T, owner string, params ...string) string {
	t.Helper()
	dsn := withParam(t, b.env.URL, "application_name", "relay-"+owner)
	for i := 0; i+1 < len(params); i += 2 {
		dsn = withParam(t, dsn, params[i], params[i+1])
	}
	return dsn
}

// withParam adds a run-time parameter to a connection string in URL or keyword/value form.
func withParam(t *testing.T, dsn, key, value string) string {
	t.Helper()
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		require.NoError(t, err)
		q := u.Query()
		q.Set(key, value)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " " + key + "='" + strings.ReplaceAll(value, "'", `\'`) + "'"
}

// leaseOf returns the owner and token of shard's lease row.
func (b *bundle) leaseOf(t *testing.T, shard int) (owner string, token int64) {
	t.Helper()
	var o *string
	require.NoError(t, b.env.Pool.QueryRow(context.Background(),
		"SELECT owner, token FROM "+b.env.Q("txbox_lease")+" WHERE shard = $1", shard).Scan(&o, &token))
	if o != nil {
		owner = *o
	}
	return owner, token
}

// leaseExpired reports whether shard's lease has expired by the database's clock.
func (b *bundle) leaseExpired(t *testing.T, shard int) bool {
	t.Helper()
	var expired bool
	require.NoError(t, b.env.Pool.QueryRow(context.Background(),
		"SELECT expires_at <= now() FROM "+b.env.Q("txbox_lease")+" WHERE shard = $1", shard).Scan(&expired))
	return expired
}

// holders returns, per owner, the shards it holds an unexpired lease on.
func (b *bundle) holders(t *testing.T) map[string][]int {
	t.Helper()
	return b.holdersAt(t, "now()")
}

// pendingAmong returns the UUIDs among uuids whose outbox rows are still pending.
func (b *bundle) pendingAmong(t *testing.T, uuids any) []string {
	t.Helper()
	var list []string
	switch u := uuids.(type) {
	case []string:
		list = u
	case map[string]bool:
		list = slices.Collect(maps.Keys(u))
	}
	rows, err := b.env.Pool.Query(context.Background(),
		"SELECT uuid FROM "+b.env.Q("txbox_outbox")+" WHERE uuid = ANY($1)", list)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// auditDeletes records every outbox row deleted, with the application that deleted it and the
// shard's lease row as the deleting transaction saw it.
func (b *bundle) auditDeletes(t *testing.T) {
	t.Helper()
	s := pgx.Identifier{b.env.Schema}.Sanitize()
	_, err := b.env.Pool.Exec(context.Background(), fmt.Sprintf(`
CREATE TABLE %[1]s.deleted (id bigint NOT NULL, uuid text NOT NULL, app text NOT NULL, lease_owner text, lease_token bigint);
CREATE FUNCTION %[1]s.audit_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO %[1]s.deleted
	SELECT OLD.id, OLD.uuid, current_setting('application_name'), l.owner, l.token
	FROM %[1]s.txbox_lease l WHERE l.shard = OLD.slot %% l.shards;
	RETURN OLD;
END $$;
CREATE TRIGGER audit_delete AFTER DELETE ON %[1]s.txbox_outbox FOR EACH ROW EXECUTE FUNCTION %[1]s.audit_delete();`, s))
	require.NoError(t, err)
}

// requireNoStaleDeletes checks that every outbox row a relay deleted, it deleted while the shard's
// lease was its own.
func (b *bundle) requireNoStaleDeletes(t *testing.T) {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(), `SELECT app, coalesce(lease_owner, '<none>'), lease_token, count(*)
		FROM `+b.env.Q("deleted")+` WHERE app LIKE 'relay-%' AND lease_owner IS DISTINCT FROM substr(app, 7) GROUP BY 1, 2, 3`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var app, owner string
		var token int64
		var n int
		require.NoError(t, rows.Scan(&app, &owner, &token, &n))
		t.Errorf("%s deleted %d row(s) while the lease belonged to %s (token %d)", app, n, owner, token)
	}
	require.NoError(t, rows.Err())
	var total int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.env.Q("deleted")).Scan(&total))
	require.NotZero(t, total, "the audit saw the relays' deletes")
}

// deletedUnder returns the UUIDs of the rows owner's relay deleted under token.
func (b *bundle) deletedUnder(t *testing.T, owner string, token int64) []string {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(),
		"SELECT uuid FROM "+b.env.Q("deleted")+" WHERE app = $1 AND lease_token = $2", "relay-"+owner, token)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// inboxTokens returns the fencing token the inbox recorded for each message it processed.
func (b *bundle) inboxTokens(t *testing.T) map[string]int64 {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(),
		"SELECT message_uuid, lease_token FROM "+b.env.Q("txbox_inbox")+" WHERE lease_token IS NOT NULL")
	require.NoError(t, err)
	out := map[string]int64{}
	for rows.Next() {
		var u string
		var tok int64
		require.NoError(t, rows.Scan(&u, &tok))
		out[u] = tok
	}
	require.NoError(t, rows.Err())
	return out
}

// droppedShard reports whether a relay's log says it dropped shard held under token: found fenced
// ("lease lost"), or run out by its own clock first ("lease ran out unrenewed"), which a relay
// woken from a pause longer than its lease may find before its next database round trip does.
func droppedShard(log string, shard int, token int64) bool {
	want := fmt.Sprintf(" shard=%d token=%d ", shard, token)
	sc := bufio.NewScanner(strings.NewReader(log))
	for sc.Scan() {
		if line := sc.Text() + " "; strings.Contains(line, `; shard dropped"`) && strings.Contains(line, want) {
			return true
		}
	}
	return false
}

// gathered returns the sum of the consumer's metric name over its labels.
func gathered(t *testing.T, c *consumer, name string) float64 {
	t.Helper()
	families, err := c.reg.Gather()
	require.NoError(t, err)
	var sum float64
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

func toSet(uuids []string) map[string]bool {
	out := make(map[string]bool, len(uuids))
	for _, u := range uuids {
		out[u] = true
	}
	return out
}
