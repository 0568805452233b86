package relay_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/relay"
)

// A relay renews its leases every LeaseTTL/3 from the start of one renewal to the start of the
// next, however long its round takes. Here each renewal takes 2/5 of a TTL to commit (a trigger
// sleeps in it, as a loaded database or machine would make it take): a relay that then waited
// another LeaseTTL/3 renewed its leases after they had run out by the database's clock, free for
// any relay to take while it was alive and well. It must keep every lease live, and say that its
// renewals come late.
func TestLeasesStayLiveWhenRenewalsAreSlow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const (
		ttl    = 6 * time.Second
		shards = 4
	)
	logs := &lockedLog{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(logs.String())
		}
	})
	r := b.startRelay(t, func(c *relay.Config) {
		c.LeaseTTL, c.Shards = ttl, shards
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	require.Eventually(t, func() bool { return len(r.Shards()) == shards }, 30*time.Second, 10*time.Millisecond)

	// A lease's expiry is one TTL from the start of the renewal's transaction, and the renewal
	// before stays in force until the next commits. A renewal that takes 2/5 of a TTL to commit:
	// begun LeaseTTL/3 after the last one ended, it commits after the last one's lease ran out; begun
	// LeaseTTL/3 after the last one began (or right after it ended), it commits with a fifth of it
	// left. Only renewals are slowed (same owner, same token): not the relay's heartbeat, whose
	// running out would call for a balance at once and hide the wait, nor the releases at the end.
	slow := ttl * 2 / 5
	s := pgx.Identifier{b.env.Schema}.Sanitize()
	_, err := b.env.Pool.Exec(context.Background(), fmt.Sprintf(`
CREATE FUNCTION %[1]s.slow_renewal() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(%[2]f); RETURN NEW; END $$;
CREATE TRIGGER slow_renewal BEFORE UPDATE ON %[1]s.txbox_lease FOR EACH ROW
	WHEN (NEW.owner IS NOT DISTINCT FROM OLD.owner AND NEW.token = OLD.token)
	EXECUTE FUNCTION %[1]s.slow_renewal();`, s, slow.Seconds()/shards))
	require.NoError(t, err)

	// Several slow renewals, each of which, with a full LeaseTTL/3 waited after it, leaves the
	// leases to run out before the next.
	require.Never(t, func() bool {
		var expired int
		require.NoError(t, b.env.Pool.QueryRow(context.Background(),
			"SELECT count(*) FROM "+b.env.Q("txbox_lease")+" WHERE expires_at <= now()").Scan(&expired))
		return expired > 0
	}, 3*(slow+ttl/3), 20*time.Millisecond, "a lease of the live relay ran out between two renewals")
	require.Len(t, r.Shards(), shards, "the relay kept its shards")
	require.Contains(t, logs.String(), "leases renewed late", "the relay says that its renewals come late")
}

// A relay cut off from the database cannot renew its leases: one TTL after its last renewal they
// have run out, free for any relay to take, and it stops counting them as its own (Shards,
// txbox_relay_shards_held), so that an outage of every relay's database path shows as no shard
// held. It kept counting them for as long as the outage lasted: one such relay beside two
// healthy ones made 20 of 16 shards held. When the database answers again, it takes them anew.
func TestARelayCutOffFromTheDatabaseStopsCountingItsLeases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := &flakyDB{Pool: b.env.Pool}
	reg := prometheus.NewRegistry()
	const ttl = time.Second
	r := b.startRelay(t, func(c *relay.Config) { c.DB, c.Registerer, c.LeaseTTL = db, reg, ttl })
	held := func() float64 {
		v, _ := sample(t, reg, "txbox_relay_shards_held", map[string]string{"schema": b.env.Schema})
		return v
	}
	require.Eventually(t, func() bool { return len(r.Shards()) == 4 && held() == 4 }, 30*time.Second, 10*time.Millisecond)
	before := r.Shards()

	db.down.Store(true)
	require.Eventually(t, func() bool { return len(r.Shards()) == 0 && held() == 0 }, 10*ttl, 10*time.Millisecond,
		"the relay still counts %v as held", r.Shards())
	// It gives them up one TTL after its last renewal began, by its clock: a round trip at most
	// before they run out by the database's.
	var expired int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.env.Q("txbox_lease")+
		" WHERE expires_at <= now() + interval '50 milliseconds'").Scan(&expired))
	require.Equal(t, 4, expired, "the relay gave its leases up only as they ran out")

	db.down.Store(false)
	require.Eventually(t, func() bool { return len(r.Shards()) == 4 && held() == 4 }, 30*time.Second, 10*time.Millisecond)
	for shard, token := range r.Shards() {
		require.Greater(t, token, before[shard], "shard %d taken anew, under a new token", shard)
	}
	b.write(t, true, "after", 5)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)
}

// lockedLog is a log destination safe for the relay's goroutines and the test's.
type lockedLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
