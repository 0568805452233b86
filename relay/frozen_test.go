package relay_test

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestFrozenRelayDelaysNoOne freezes relay A (SIGSTOP from a failpoint) while it holds a lease row
// locked inside a fenced transaction, then starts relay C while relay B is healthy. A frozen process
// must never delay anyone else: C starts and takes its share, B renews every lease it keeps (none
// of them ever runs out, by the database's clock), and A's shards are taken over within 1.5 lease
// TTLs of the freeze. Everything is processed once, in key order, once A wakes and gives up.
func TestFrozenRelayDelaysNoOne(t *testing.T) {
	t.Parallel()
	const shards = 16
	ttl := 2 * time.Second
	b := setup(t)
	b.logLeases(t)
	b.startConsumer(t)
	args := []string{"--shards", fmt.Sprint(shards), "--lease-ttl", ttl.String()}
	a := b.startRelayProc(t, "A", "relay.lease-locked=stop@40", args...)
	bp := b.startRelayProc(t, "B", "", args...)
	// C's process is started now and stops before it does anything, so that it starts for real the
	// moment it is woken, while A is frozen, rather than after a process's start-up time.
	c := b.startRelayProc(t, "C", "relay.before-start=stop", args...)
	require.Eventually(t, func() bool { return strings.Contains(c.Output(), "txbox failpoint:") }, 30*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool { return balanced(b.holders(t), []string{"A", "B"}, shards) }, 30*time.Second, 20*time.Millisecond,
		"A and B share the shards")
	prod := b.produce(t, 8, 10*time.Millisecond)

	require.Eventually(t, func() bool { return strings.Contains(a.Output(), "txbox failpoint:") }, 60*time.Second, 5*time.Millisecond,
		"A froze inside a fenced transaction")
	// The moment A's session went idle inside its transaction, holding the lease row lock.
	var frozenAt time.Time
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), `SELECT state_change FROM pg_stat_activity
		WHERE application_name = 'relay-A' AND state = 'idle in transaction' ORDER BY state_change DESC LIMIT 1`).Scan(&frozenAt),
		"A holds a transaction open")
	victims := b.holders(t)["A"]
	require.NotEmpty(t, victims)

	c.Signal(syscall.SIGCONT)
	// Until every shard of A is someone else's, B keeps each lease it holds alive.
	require.Eventually(t, func() bool {
		var expired []int
		require.NoError(t, b.env.Pool.QueryRow(context.Background(), `SELECT coalesce(array_agg(shard), '{}') FROM `+b.env.Q("txbox_lease")+`
			WHERE owner = 'B' AND expires_at <= now()`).Scan(&expired))
		require.Empty(t, expired, "a lease of the healthy relay B ran out")
		h := b.holders(t)
		for _, s := range victims {
			held := false
			for _, o := range []string{"B", "C"} {
				for _, hs := range h[o] {
					held = held || hs == s
				}
			}
			if !held {
				return false
			}
		}
		return len(h["C"]) > 0
	}, 10*ttl, 10*time.Millisecond, "B and C took A's shards over, and C started")

	for _, s := range victims {
		h := b.takeoverOf(t, s, "A")
		took := h.at.Sub(frozenAt)
		t.Logf("shard %d: taken by %s %v after A froze (%v after its lease ran out)", s, h.owner, took.Round(time.Millisecond),
			h.at.Sub(h.prevExpiresAt).Round(time.Millisecond))
		require.LessOrEqual(t, took, ttl*3/2, "shard %d taken over within 1.5 lease TTLs of the freeze", s)
	}
	require.NotContains(t, bp.Output(), "lease lost; shard dropped", "B lost no lease")
	require.NotContains(t, c.Output(), "lease lost; shard dropped", "C lost no lease")

	a.Signal(syscall.SIGCONT)
	b.requireProcessedOnceInOrder(t, prod.stop(t))
}
