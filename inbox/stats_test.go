package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
)

// dedupStat returns the durable dedup counts of (consumer, handler) over the last hour.
func dedupStat(t *testing.T, b *bundle, consumer, handler string) (inbox.DedupStat, bool) {
	t.Helper()
	stats, err := inbox.DedupStats(context.Background(), b.env.Pool, b.env.Schema, time.Hour)
	require.NoError(t, err)
	for _, s := range stats {
		if s.Consumer == consumer && s.Handler == handler {
			return s, true
		}
	}
	return inbox.DedupStat{}, false
}

// The dedup checks and hits are written to the database, so that a later process (txbox status)
// reads the hit rate: the first delivery's counts at once, in the background, later ones when the
// interval has passed or the inbox is flushed.
func TestDedupCountsOutliveTheProcess(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *inbox.Config) { c.StatsInterval = time.Hour })
	h := b.inbox.Middleware(b.handler(nil))

	first := newMessage()
	require.NoError(t, deliver(h, first))
	require.Eventually(t, func() bool {
		s, ok := dedupStat(t, b, "billing", "")
		return ok && s.Checks == 1
	}, 10*time.Second, 10*time.Millisecond, "the first counts are written without waiting for the interval")

	// Within the interval the counts wait in memory: no statement per message.
	second := newMessage()
	for range 3 {
		require.NoError(t, deliver(h, second))
	}
	require.NoError(t, deliver(h, first))
	s, _ := dedupStat(t, b, "billing", "")
	require.Equal(t, int64(1), s.Checks, "nothing written before the interval passed")

	require.NoError(t, b.inbox.Flush(context.Background()))
	s, ok := dedupStat(t, b, "billing", "")
	require.True(t, ok)
	require.Equal(t, int64(5), s.Checks)
	require.Equal(t, int64(3), s.Hits)
	require.InDelta(t, 0.6, s.HitRate, 1e-9)
	require.WithinDuration(t, time.Now(), s.Updated, time.Minute)
	require.False(t, s.Since.After(s.Updated))

	// A flush with nothing new writes nothing and keeps the figures.
	require.NoError(t, b.inbox.Flush(context.Background()))
	again, _ := dedupStat(t, b, "billing", "")
	require.Equal(t, s.Checks, again.Checks)
}

// Counts left pending when messages stop coming are written once their interval has passed: a
// consumer that goes quiet does not keep its last counts in memory until the next message.
func TestDedupCountsOfAQuietConsumerAreWrittenOnceDue(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *inbox.Config) { c.StatsInterval = 200 * time.Millisecond })
	h := b.inbox.Middleware(b.handler(nil))
	msg := newMessage()
	for range 4 { // The first delivery's counts are written at once, the others wait for the interval.
		require.NoError(t, deliver(h, msg))
	}
	require.Eventually(t, func() bool {
		s, ok := dedupStat(t, b, "billing", "")
		return ok && s.Checks == 4 && s.Hits == 3
	}, time.Minute, 20*time.Millisecond, "every count is written without another message or a Flush")
}

// Counts older than the window are not part of the rate.
func TestDedupStatsWindow(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.inbox.Middleware(b.handler(nil))
	msg := newMessage()
	require.NoError(t, deliver(h, msg))
	require.NoError(t, deliver(h, msg))
	require.NoError(t, b.inbox.Flush(context.Background()))
	_, err := b.env.Pool.Exec(context.Background(),
		"UPDATE "+b.env.Q("txbox_dedup_stats")+" SET minute = minute - interval '2 hours'")
	require.NoError(t, err)
	_, ok := dedupStat(t, b, "billing", "")
	require.False(t, ok, "counts from two hours ago are outside a one-hour window")

	require.NoError(t, deliver(h, msg))
	require.NoError(t, b.inbox.Flush(context.Background()))
	s, ok := dedupStat(t, b, "billing", "")
	require.True(t, ok)
	require.Equal(t, int64(1), s.Checks)
	require.Equal(t, int64(1), s.Hits)
}

// With the durable counts disabled nothing is written.
func TestDedupStatsCanBeDisabled(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *inbox.Config) { c.StatsInterval = -1 })
	h := b.inbox.Middleware(b.handler(nil))
	require.NoError(t, deliver(h, newMessage()))
	require.NoError(t, b.inbox.Flush(context.Background()))
	_, ok := dedupStat(t, b, "billing", "")
	require.False(t, ok)
}
