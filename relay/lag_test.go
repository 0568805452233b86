package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/relay"
)

func TestLagMonitorReportsWhatAGroupHasNotConsumed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	brokers := kafkatest.Brokers(t)
	// Idempotent, not transactional: a Kafka transaction leaves a commit marker that takes an offset
	// of its own, so the lag of a transactional topic is off by up to one per partition.
	idempotent, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers, Transactional: new(bool)})
	require.NoError(t, err)
	b.startRelay(t, func(c *relay.Config) { c.Sink = idempotent })
	group := "lag-" + watermill.NewShortUUID()
	reg := prometheus.NewRegistry()
	mon, err := relay.NewLagMonitor(relay.LagConfig{Brokers: brokers, Groups: []string{group}, Registerer: reg})
	require.NoError(t, err)
	ctx := context.Background()

	// The group consumes the first 10 messages and commits.
	first := b.write(t, true, "k", 10)
	sub, err := kafka.NewSubscriber(kafkatest.SubscriberConfig(brokers, group), watermill.NopLogger{})
	require.NoError(t, err)
	subCtx, cancel := context.WithCancel(ctx)
	ch, err := sub.Subscribe(subCtx, b.topic)
	require.NoError(t, err)
	for range first {
		m := <-ch
		m.Ack()
	}
	require.Eventually(t, func() bool {
		lag, err := mon.Measure(ctx)
		return err == nil && len(lag[group]) == 1 && lag[group][b.topic] == 0
	}, 30*time.Second, 50*time.Millisecond, "the committed group has no lag")
	cancel()
	require.NoError(t, sub.Close())

	// With the group gone, 5 more messages are published: the lag is 5.
	b.write(t, true, "k", 5)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool {
		lag, err := mon.Measure(ctx)
		return err == nil && lag[group][b.topic] == 5
	}, 30*time.Second, 50*time.Millisecond)

	// A group that cannot be measured (this broker may refuse a group it never saw) leaves the
	// others measured: one missing group took every group's lag away.
	missing := "lag-missing-" + watermill.NewShortUUID()
	both, err := relay.NewLagMonitor(relay.LagConfig{Brokers: brokers, Groups: []string{missing, group}, Registerer: reg})
	require.NoError(t, err)
	lag, err := both.Measure(ctx)
	if err != nil {
		require.ErrorContains(t, err, missing)
		require.NotContains(t, err.Error(), group+":")
	}
	require.Equal(t, int64(5), lag[group][b.topic])

	// The lag of a group that cannot be measured keeps its last value, so when it was last
	// measured is reported too, and only a measurement that succeeds moves it: a lag alert saw a
	// flat lag while the group fell behind unmeasured.
	measured := func(group string) (float64, bool) {
		families, err := reg.Gather()
		require.NoError(t, err)
		for _, f := range families {
			for _, m := range f.GetMetric() {
				if f.GetName() == "txbox_consumer_lag_timestamp_seconds" && m.GetLabel()[0].GetValue() == group {
					return m.GetGauge().GetValue(), true
				}
			}
		}
		return 0, false
	}
	at, ok := measured(group)
	require.True(t, ok)
	require.InDelta(t, float64(time.Now().Unix()), at, 60, "a measurement that succeeded is reported")
	if err != nil {
		_, ok := measured(missing)
		require.False(t, ok, "a group that could not be measured has no time of measurement")
	}
	// The same gauges, from a monitor whose Kafka does not answer.
	cutOff, err := relay.NewLagMonitor(relay.LagConfig{Brokers: []string{"127.0.0.1:1"}, Groups: []string{group}, Registerer: reg})
	require.NoError(t, err)
	_, err = cutOff.Measure(ctx)
	require.Error(t, err)
	again, _ := measured(group)
	require.Equal(t, at, again, "a measurement that failed leaves the time of the last one")
}

func TestLagConfigIsValidated(t *testing.T) {
	t.Parallel()
	_, err := relay.NewLagMonitor(relay.LagConfig{Groups: []string{"g"}})
	require.ErrorContains(t, err, "LagConfig.Brokers")
	_, err = relay.NewLagMonitor(relay.LagConfig{Brokers: []string{"x:1"}})
	require.ErrorContains(t, err, "LagConfig.Groups")
}
