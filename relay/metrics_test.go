package relay_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/relay"
)

// sample returns the value of the series name{labels} in reg (a counter's or a gauge's), and
// whether it exists. Other labels of the series must not be named in labels.
func sample(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	gathered, err := reg.Gather()
	require.NoError(t, err)
	families := make(map[string]*dto.MetricFamily, len(gathered))
	for _, f := range gathered {
		families[f.GetName()] = f
	}
	switch m := series(families, name, labels); {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue(), true
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue(), true
	}
	return 0, false
}

// Two relays in one process, on two outboxes (schemas), registered in one registry: each one's
// series carry its schema, so neither adds to the other's counts and neither overwrites the other's
// gauges.
func TestTwoRelaysInOneProcessKeepTheirMetricsApart(t *testing.T) {
	t.Parallel()
	a, b := setup(t), setup(t)
	reg := prometheus.NewRegistry()
	withReg := func(c *relay.Config) { c.Registerer = reg }
	a.startRelay(t, withReg)
	b.startRelay(t, func(c *relay.Config) { withReg(c); c.Shards = 2; c.LeaseTTL = 3 * time.Second })

	a.write(t, true, "k", 3)
	b.write(t, true, "k", 5)
	require.Eventually(t, func() bool { return a.pending(t) == 0 && b.pending(t) == 0 }, 30*time.Second, 20*time.Millisecond)

	for _, c := range []struct {
		schema               string
		published, held, ttl float64
	}{
		{a.env.Schema, 3, 4, 2},
		{b.env.Schema, 5, 2, 3},
	} {
		of := map[string]string{"schema": c.schema}
		require.Eventually(t, func() bool {
			v, _ := sample(t, reg, "txbox_relay_published_total", of)
			return v == c.published
		}, 10*time.Second, 20*time.Millisecond, "published by the relay of %s", c.schema)
		require.Eventually(t, func() bool {
			v, _ := sample(t, reg, "txbox_relay_shards_held", of)
			return v == c.held
		}, 10*time.Second, 20*time.Millisecond, "shards held by the relay of %s", c.schema)
		ttl, ok := sample(t, reg, "txbox_relay_lease_ttl_seconds", of)
		require.True(t, ok, "lease TTL of the relay of %s", c.schema)
		require.Equal(t, c.ttl, ttl)
	}
}
