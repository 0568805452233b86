package relay_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// Transactions that take lower ids but commit after higher ones, in random interleavings, while the
// relay is polling: no row is skipped and none is read before it commits.
func TestOutOfOrderCommitsAreNeverSkipped(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	b.startRelay(t, nil)
	ctx := context.Background()
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, seed))

	var all []string
	for iter := range 30 {
		n := 2 + rng.IntN(5)
		txs := make([]pgx.Tx, n)
		uuids := make([]string, n)
		for i := range n {
			tx, err := b.env.Pool.Begin(ctx)
			require.NoError(t, err)
			m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(iter, i)))
			outbox.SetPartitionKey(m, fmt.Sprintf("k%d", rng.IntN(3)))
			require.NoError(t, b.writer.Publish(ctx, tx, b.topic, m)) // ids are taken in order i
			txs[i], uuids[i] = tx, m.UUID
		}
		// Commit in a random order, giving the relay time to poll between commits, and roll one back
		// now and then.
		rolledBack := -1
		if rng.IntN(3) == 0 {
			rolledBack = rng.IntN(n)
		}
		for _, i := range rng.Perm(n) {
			if i == rolledBack {
				require.NoError(t, txs[i].Rollback(ctx))
				continue
			}
			require.NoError(t, txs[i].Commit(ctx))
			all = append(all, uuids[i])
			if rng.IntN(2) == 0 {
				waitPolled(t, b)
			}
		}
	}
	require.Eventually(t, func() bool { return c.has(all...) }, 60*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 10*time.Second, 20*time.Millisecond)
}

// waitPolled waits until the relay has drained what is committed, so the next commit lands
// behind a relay that already moved past its id.
func waitPolled(t *testing.T, b *bundle) {
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 2*time.Millisecond)
}

// Many producers write concurrently; each producer's transactions run one after the other on its
// own key, so its messages must arrive in the order it committed them.
func TestConcurrentProducersKeepPerKeyOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	b.startRelay(t, func(cfg *relay.Config) { cfg.BatchSize = 37 })
	const producers, perProducer = 8, 60
	ctx := context.Background()
	written := make([][]string, producers)
	var wg sync.WaitGroup
	for p := range producers {
		wg.Go(func() {
			key := fmt.Sprintf("producer-%d", p)
			for i := 0; i < perProducer; {
				// 1-3 messages per transaction.
				n := min(1+rand.IntN(3), perProducer-i)
				tx, err := b.env.Pool.Begin(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				var msgs []*message.Message
				for range n {
					msgs = append(msgs, outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), nil), key))
				}
				if err := b.writer.Publish(ctx, tx, b.topic, msgs...); err != nil {
					t.Error(err)
					_ = tx.Rollback(ctx)
					return
				}
				if err := tx.Commit(ctx); err != nil {
					t.Error(err)
					return
				}
				for _, m := range msgs {
					written[p] = append(written[p], m.UUID)
				}
				i += n
			}
		})
	}
	wg.Wait()
	var all []string
	for _, w := range written {
		all = append(all, w...)
	}
	require.Eventually(t, func() bool { return c.has(all...) }, 60*time.Second, 20*time.Millisecond)
	c.mu.Lock()
	defer c.mu.Unlock()
	for p, w := range written {
		require.Equal(t, w, firstSeen(c.order[fmt.Sprintf("producer-%d", p)]), "order of producer %d", p)
	}
}

// firstSeen drops repeated copies, keeping each UUID's first arrival.
func firstSeen(uuids []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, u := range uuids {
		if !seen[u] {
			seen[u] = true
			out = append(out, u)
		}
	}
	return out
}
