package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/proctest"
)

// Tests of scale-out: several `txbox relay` processes share the shards of one outbox, take a dead
// relay's shards over, hand shards over on a graceful stop, and rebalance when relays come and
// go, all without losing, duplicating (in effect) or reordering a key's messages.

const scaleTTL = time.Second // the lease TTL of the relays in these tests

// relays runs n relay processes named r0..r(n-1) with the given shard count.
func (b *bundle) relays(t *testing.T, n, shards int) []*proctest.Proc {
	t.Helper()
	procs := make([]*proctest.Proc, n)
	for i := range procs {
		procs[i] = b.startRelayProc(t, fmt.Sprintf("r%d", i), "", "--shards", fmt.Sprint(shards), "--lease-ttl", scaleTTL.String())
	}
	return procs
}

// balanced reports whether every shard is held and each of the owners holds its fair share.
func balanced(held map[string][]int, owners []string, shards int) bool {
	total := 0
	for _, s := range held {
		total += len(s)
	}
	if total != shards || len(held) != len(owners) {
		return false
	}
	fair := shards / len(owners) // the fair share rounds up; nobody holds less than it rounded down
	for _, o := range owners {
		if len(held[o]) < fair {
			return false
		}
	}
	return true
}

// TestRelayCrashIsTakenOverWithinALeaseTTL kills one of three relays with SIGKILL while producers
// write: the other two take its shards over once its leases run out, and every message is
// processed once, in key order. Takeover times are measured on the database's clock, from the
// lease history a trigger records.
func TestRelayCrashIsTakenOverWithinALeaseTTL(t *testing.T) {
	t.Parallel()
	const shards = 8
	b := setup(t)
	b.logLeases(t)
	b.startConsumer(t)
	procs := b.relays(t, 3, shards)
	prod := b.produce(t, 8, 20*time.Millisecond)
	require.Eventually(t, func() bool { return balanced(b.holders(t), []string{"r0", "r1", "r2"}, shards) }, 30*time.Second, 20*time.Millisecond,
		"the three relays share the shards")
	require.Eventually(t, func() bool { return prod.written() > 100 }, 30*time.Second, 10*time.Millisecond)

	victim := b.holders(t)["r1"]
	procs[1].Signal(syscall.SIGKILL)
	require.Equal(t, -1, procs[1].Wait(10*time.Second))
	killedAt := b.dbNow(t)
	require.Eventually(t, func() bool { return balanced(b.holders(t), []string{"r0", "r2"}, shards) }, 10*scaleTTL, 20*time.Millisecond,
		"the survivors hold every shard")

	for _, s := range victim {
		h := b.takeoverOf(t, s, "r1")
		require.False(t, h.at.Before(h.prevExpiresAt), "shard %d was taken before r1's lease ran out", s)
		afterExpiry, afterKill := h.at.Sub(h.prevExpiresAt), h.at.Sub(killedAt)
		t.Logf("shard %d: taken by %s %v after r1's lease ran out, %v after the kill", s, h.owner, afterExpiry.Round(time.Millisecond), afterKill.Round(time.Millisecond))
		require.LessOrEqual(t, afterExpiry, scaleTTL, "shard %d taken over within one lease TTL of its lease running out", s)
		// One TTL for the lease to run out, at most one more for the survivors' next look.
		require.LessOrEqual(t, afterKill, 2*scaleTTL, "shard %d taken over soon after the crash", s)
	}
	b.requireProcessedOnceInOrder(t, prod.stop(t))
}

// TestRollingRestartUnderLoad restarts each of three relays in turn (SIGTERM, wait for a clean
// exit, start it again under the same name) while producers write. Each stop hands the relay's
// shards over; each start takes a fair share back. Nothing is lost, nothing is processed twice,
// every key stays in order, and the test reports how many duplicate deliveries the inbox dropped.
func TestRollingRestartUnderLoad(t *testing.T) {
	t.Parallel()
	const shards = 8
	owners := []string{"r0", "r1", "r2"}
	b := setup(t)
	b.logLeases(t)
	b.auditDeletes(t)
	cons := b.startConsumer(t)
	procs := b.relays(t, 3, shards)
	prod := b.produce(t, 8, 20*time.Millisecond)
	require.Eventually(t, func() bool { return balanced(b.holders(t), owners, shards) }, 30*time.Second, 20*time.Millisecond)

	for i, name := range owners {
		before := prod.written()
		procs[i].Signal(syscall.SIGTERM)
		require.Equal(t, 0, procs[i].Wait(30*time.Second), "%s stopped cleanly", name)
		require.Contains(t, procs[i].Output(), `msg="lease released"`, "%s handed its shards over", name)
		rest := slices.Delete(slices.Clone(owners), i, i+1)
		require.Eventually(t, func() bool { return balanced(b.holders(t), rest, shards) }, 10*scaleTTL, 20*time.Millisecond,
			"the other two hold every shard while %s is down", name)

		procs[i] = b.startRelayProc(t, name, "", "--shards", fmt.Sprint(shards), "--lease-ttl", scaleTTL.String())
		require.Eventually(t, func() bool { return balanced(b.holders(t), owners, shards) }, 30*time.Second, 20*time.Millisecond,
			"the restarted %s got its share back", name)
		require.Eventually(t, func() bool { return prod.written() > before+20 }, 30*time.Second, 10*time.Millisecond, "still under load")
	}

	order := prod.stop(t)
	b.requireProcessedOnceInOrder(t, order)
	b.requireNoStaleDeletes(t)
	lost := 0
	for _, p := range procs {
		lost += strings.Count(p.Output(), "lease lost; shard dropped")
	}
	var handoffs int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.env.Q("lease_log")).Scan(&handoffs))
	t.Logf("rolling restart: %d lease acquisitions, %d leases lost by a running relay (fenced), the inbox dropped %v duplicate(s), %v message(s) came with a superseded token",
		handoffs, lost, gathered(t, cons, "txbox_dedup_hits_total"), gathered(t, cons, "txbox_superseded_token_messages_total"))
}

// TestLeaseClock shows that lease decisions follow the database's clock, whatever the relays'
// own clocks say.
//
// A Go program's clock cannot be skewed from outside (it reads the time through the vDSO, so
// libfaketime does not reach it), and a hook inside the relay would only skew the reads that go
// through it. So the test skews the other side: the relays' sessions see a database clock an hour
// behind or ahead of their own (a schema on their search_path overrides now() and its relatives),
// which to the relays is exactly a host clock an hour ahead or behind the database's. Under each
// skew, and with none, two relays must share the shards without taking each other's live leases,
// every lease must expire one TTL after it was taken or renewed by the database's clock, and a
// relay killed with SIGKILL must have its shards taken over once its leases run out.
//
// Any lease decision made on the relay's own clock fails this test: expiries written from the
// local clock are an hour off (born expired, or lasting an hour), expiry compared with the local
// clock makes live leases look expired (they get stolen) or dead ones look alive (no takeover).
func TestLeaseClock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		ahead time.Duration // how far the relays' clocks are ahead of the database's
	}{
		{"relay clocks an hour ahead", time.Hour},
		{"relay clocks in step", 0},
		{"relay clocks an hour behind", -time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const shards = 4
			ttl := 1500 * time.Millisecond
			b := setup(t)
			b.logLeases(t)
			b.startConsumer(t)
			dbNow, clock := "pg_catalog.now()", ""
			if tc.ahead != 0 {
				// The database's clock as the relays see it: behind theirs by tc.ahead.
				dbNow = fmt.Sprintf("(pg_catalog.now() - interval '%d seconds')", int(tc.ahead.Seconds()))
				clock = b.skewClock(t, -tc.ahead)
			}
			start := func(owner string) *proctest.Proc {
				args := []string{"--shards", fmt.Sprint(shards), "--lease-ttl", ttl.String()}
				if clock != "" {
					args = append(args, "--database-url", b.relayDSN(t, owner, "search_path", clock+",pg_catalog"))
				}
				return b.startRelayProc(t, owner, "", args...)
			}
			a, _ := start("A"), start("B")
			prod := b.produce(t, 6, 20*time.Millisecond)
			require.Eventually(t, func() bool { return balanced(b.holdersAt(t, dbNow), []string{"A", "B"}, shards) }, 30*time.Second, 20*time.Millisecond,
				"A and B share the shards")

			// While both are alive, no lease changes hands and each held lease runs out within one
			// TTL by the database's clock. The point is the passage of time: several renewals.
			var acquisitions int
			require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.env.Q("lease_log")).Scan(&acquisitions))
			require.Never(t, func() bool {
				var n int
				var ok bool
				require.NoError(t, b.env.Pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM `+b.env.Q("lease_log")+`),
					(SELECT bool_and(expires_at > `+dbNow+` AND expires_at <= `+dbNow+` + $1 * interval '1 millisecond')
					FROM `+b.env.Q("txbox_lease")+` WHERE owner IS NOT NULL)`, ttl.Milliseconds()).Scan(&n, &ok))
				if n != acquisitions || !ok {
					t.Logf("leases by the database's clock: %v; the relays' logs show when each renewed", b.leaseStates(t, dbNow))
					return true
				}
				return false
			}, 2*ttl, 20*time.Millisecond, "a live lease changed hands, or a held lease does not run out within one TTL of the database's now")

			victim := b.holdersAt(t, dbNow)["A"]
			a.Signal(syscall.SIGKILL)
			require.Equal(t, -1, a.Wait(10*time.Second))
			killedAt := b.dbNowAt(t, dbNow)
			require.Eventually(t, func() bool { return balanced(b.holdersAt(t, dbNow), []string{"B"}, shards) }, 10*ttl, 20*time.Millisecond,
				"B took A's shards over")
			for _, s := range victim {
				h := b.takeoverOf(t, s, "A")
				require.False(t, h.at.Before(h.prevExpiresAt), "shard %d was taken before A's lease ran out", s)
				require.LessOrEqual(t, h.at.Sub(h.prevExpiresAt), ttl, "shard %d taken over within one lease TTL of its lease running out", s)
				require.LessOrEqual(t, h.at.Sub(killedAt), 2*ttl, "shard %d taken over soon after the crash", s)
				t.Logf("shard %d: taken over %v after A's lease ran out", s, h.at.Sub(h.prevExpiresAt).Round(time.Millisecond))
			}

			// Every lease ever taken expired exactly one TTL after it was taken, and none was taken
			// before the previous one ran out.
			rows, err := b.env.Pool.Query(context.Background(), `SELECT shard, token,
				round(extract(epoch FROM expires_at - at) * 1000)::bigint, at < prev_expires_at
				FROM `+b.env.Q("lease_log")+` ORDER BY seq`)
			require.NoError(t, err)
			for rows.Next() {
				var shard int
				var token, lastsMs int64
				var early bool
				require.NoError(t, rows.Scan(&shard, &token, &lastsMs, &early))
				require.Equal(t, ttl.Milliseconds(), lastsMs, "lease of shard %d under token %d lasts one TTL by the database's clock", shard, token)
				require.False(t, early, "lease of shard %d under token %d was taken before the previous one ran out", shard, token)
			}
			require.NoError(t, rows.Err())

			b.requireProcessedOnceInOrder(t, prod.stop(t))
		})
	}
}

// leaseStates describes each lease row (owner, token, time left) by the clock expression now.
func (b *bundle) leaseStates(t *testing.T, now string) []string {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(), `SELECT format('shard %s: %s token %s, %s ms left', shard, owner, token,
		round(extract(epoch FROM expires_at - `+now+`) * 1000)) FROM `+b.env.Q("txbox_lease")+` ORDER BY shard`)
	require.NoError(t, err)
	states, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return states
}

// skewClock creates a schema whose now() and relatives run offset from the database's clock, to
// put in front of pg_catalog on a session's search_path; it is dropped when the test ends.
func (b *bundle) skewClock(t *testing.T, offset time.Duration) string {
	t.Helper()
	schema := b.env.Schema + "_clock"
	q := pgx.Identifier{schema}.Sanitize()
	shift := fmt.Sprintf("interval '%d seconds'", int(offset.Seconds()))
	sql := "CREATE SCHEMA " + q + ";\n"
	for _, f := range []struct{ name, volatility string }{
		{"now", "STABLE"}, {"transaction_timestamp", "STABLE"}, {"statement_timestamp", "STABLE"}, {"clock_timestamp", "VOLATILE"},
	} {
		sql += fmt.Sprintf("CREATE FUNCTION %s.%s() RETURNS timestamptz LANGUAGE sql %s AS $$ SELECT pg_catalog.%s() + %s $$;\n",
			q, f.name, f.volatility, f.name, shift)
	}
	_, err := b.env.Pool.Exec(context.Background(), sql)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := b.env.Pool.Exec(context.Background(), "DROP SCHEMA "+q+" CASCADE")
		require.NoError(t, err)
	})
	return schema
}

// logLeases records every change of a lease's token (every acquisition): when, by the clock of
// the acquiring session, and what it replaced.
func (b *bundle) logLeases(t *testing.T) {
	t.Helper()
	s := pgx.Identifier{b.env.Schema}.Sanitize()
	_, err := b.env.Pool.Exec(context.Background(), fmt.Sprintf(`
CREATE TABLE %[1]s.lease_log (seq bigint GENERATED ALWAYS AS IDENTITY, shard integer NOT NULL, owner text,
	token bigint NOT NULL, at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
	prev_owner text, prev_expires_at timestamptz NOT NULL);
CREATE FUNCTION %[1]s.log_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	-- now(), unqualified, is the acquiring session's clock: skewed where TestLeaseClock skews it.
	INSERT INTO %[1]s.lease_log (shard, owner, token, at, expires_at, prev_owner, prev_expires_at)
	VALUES (NEW.shard, NEW.owner, NEW.token, now(), NEW.expires_at, OLD.owner, OLD.expires_at);
	RETURN NEW;
END $$;
CREATE TRIGGER log_lease AFTER UPDATE ON %[1]s.txbox_lease FOR EACH ROW
	WHEN (NEW.token IS DISTINCT FROM OLD.token) EXECUTE FUNCTION %[1]s.log_lease();`, s))
	require.NoError(t, err)
}

// takeover is one acquisition of a shard's lease from a given previous owner.
type takeover struct {
	owner         string
	at            time.Time
	prevExpiresAt time.Time
}

// takeoverOf returns the acquisition of shard's lease that followed prev's lease.
func (b *bundle) takeoverOf(t *testing.T, shard int, prev string) takeover {
	t.Helper()
	var h takeover
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), `SELECT owner, at, prev_expires_at FROM `+b.env.Q("lease_log")+`
		WHERE shard = $1 AND prev_owner = $2 ORDER BY seq DESC LIMIT 1`, shard, prev).Scan(&h.owner, &h.at, &h.prevExpiresAt))
	return h
}

// dbNow returns the database's clock.
func (b *bundle) dbNow(t *testing.T) time.Time { return b.dbNowAt(t, "now()") }

func (b *bundle) dbNowAt(t *testing.T, now string) time.Time {
	t.Helper()
	var ts time.Time
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT "+now).Scan(&ts))
	return ts
}

// holdersAt is holders by the clock expression now.
func (b *bundle) holdersAt(t *testing.T, now string) map[string][]int {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(),
		"SELECT owner, shard FROM "+b.env.Q("txbox_lease")+" WHERE owner IS NOT NULL AND expires_at > "+now+" ORDER BY shard")
	require.NoError(t, err)
	out := map[string][]int{}
	for rows.Next() {
		var o string
		var s int
		require.NoError(t, rows.Scan(&o, &s))
		out[o] = append(out[o], s)
	}
	require.NoError(t, rows.Err())
	return out
}
