package relay_test

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
)

// relayArgs are the flags of a `txbox relay` process for the bundle's schema.
func (b *bundle) relayArgs(t *testing.T, extra ...string) []string {
	return append([]string{"relay",
		"--database-url", b.env.URL, "--schema", b.env.Schema,
		"--kafka-brokers", strings.Join(kafkatest.Brokers(t), ","),
		"--transactional-id-prefix", b.env.Schema,
		"--shards", "4", "--lease-ttl", "1s", "--poll-interval", "10ms", "--metrics-addr", "",
	}, extra...)
}

// A relay killed with SIGKILL after Kafka committed a batch but before the rows were marked done
// leaves them pending; the next relay publishes them again and the inbox drops the copies.
func TestRelayKilledBetweenPublishAndCompletion(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	b.startConsumer(t)
	uuids := b.write(t, true, "order-7", 10)

	crashing := proctest.Start(t, []string{failpoint.EnvVar + "=relay.after-publish"}, b.relayArgs(t)...)
	require.Equal(t, -1, crashing.Wait(60*time.Second), "the relay died by SIGKILL at the failpoint")
	require.Eventually(t, func() bool { return c.has(uuids...) }, 30*time.Second, 20*time.Millisecond,
		"the batch reached Kafka before the crash")
	require.Equal(t, 10, b.pending(t), "nothing was marked done")

	proctest.Start(t, nil, b.relayArgs(t)...)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 60*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool {
		for _, u := range uuids {
			if c.count(u) < 2 {
				return false
			}
		}
		return true
	}, 30*time.Second, 20*time.Millisecond, "every message was published twice")
	require.Eventually(t, func() bool { return b.allAppliedOnce(t, uuids) }, 30*time.Second, 20*time.Millisecond)

	// Give the consumer the chance to process every copy before the final count.
	marker := b.write(t, true, "order-7", 1)
	require.Eventually(t, func() bool { return b.allAppliedOnce(t, marker) }, 30*time.Second, 20*time.Millisecond)
	applied, order := b.effects(t)
	for _, u := range uuids {
		require.Equal(t, 1, applied[u], "business effect of %s", u)
	}
	require.Equal(t, append(uuids, marker...), order["order-7"], "per-key order")
}

// SIGTERM stops a relay gracefully: it gives its leases up, so the next relay starts at once.
func TestRelayStopsGracefullyOnSIGTERM(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.collect(t)
	p := proctest.Start(t, nil, b.relayArgs(t, "--lease-ttl", "30s")...)
	first := b.write(t, true, "k", 5)
	require.Eventually(t, func() bool { return c.has(first...) }, 60*time.Second, 20*time.Millisecond)
	p.Signal(syscall.SIGTERM)
	require.Equal(t, 0, p.Wait(30*time.Second), p.Output())

	var held int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(),
		"SELECT count(*) FROM "+b.env.Q("txbox_lease")+" WHERE expires_at > now()").Scan(&held))
	require.Zero(t, held, "leases released on shutdown")

	// With a 30s TTL, only released leases let a new relay publish this quickly.
	proctest.Start(t, nil, b.relayArgs(t, "--lease-ttl", "30s")...)
	second := b.write(t, true, "k", 5)
	require.Eventually(t, func() bool { return c.has(second...) }, 20*time.Second, 20*time.Millisecond)
}
