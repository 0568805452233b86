package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/txbox/txbox/internal/metrics"
)

// LagConfig configures a LagMonitor.
type LagConfig struct {
	// Brokers to ask. Required.
	Brokers []string
	// Groups are the consumer groups whose lag is reported. Required.
	Groups []string
	// Interval between measurements. If not specified, defaults to 15s.
	Interval time.Duration
	// Sarama, when set, is the base client configuration (TLS, SASL...).
	Sarama *sarama.Config
	// Logger receives errors, once per failing streak. If not specified, slog.Default().
	Logger *slog.Logger
	// Registerer receives txbox_consumer_lag_messages and txbox_consumer_lag_timestamp_seconds. If
	// not specified, they are not registered.
	Registerer prometheus.Registerer
}

// LagMonitor reports txbox_consumer_lag_messages{group,topic}: for each partition a group has
// committed an offset on, the partition's high-water mark minus that offset, summed per topic. A
// sustained rise means the consumers fall behind. Partitions a group never committed on are not
// counted. With transactional publishing each transaction's commit marker takes an offset that no
// consumer receives, and so does the abort marker of a transaction a killed or fenced relay left
// open, so an idle group shows a small lag per partition that never drains; watch the trend.
// It also reports when it last measured each group, txbox_consumer_lag_timestamp_seconds{group}:
// the lag of a group that cannot be measured keeps its last value.
type LagMonitor struct {
	cfg     LagConfig
	metrics *metrics.ConsumerLag
}

// NewLagMonitor validates cfg and returns a LagMonitor.
func NewLagMonitor(cfg LagConfig) (*LagMonitor, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("relay: LagConfig.Brokers is required")
	}
	if len(cfg.Groups) == 0 {
		return nil, errors.New("relay: LagConfig.Groups is required")
	}
	if cfg.Interval == 0 {
		cfg.Interval = 15 * time.Second
	}
	if cfg.Interval < 0 {
		return nil, fmt.Errorf("relay: LagConfig.Interval must be positive, got %s", cfg.Interval)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &LagMonitor{cfg: cfg, metrics: metrics.NewConsumerLag(cfg.Registerer)}, nil
}

// Measure returns the current lag per group and topic, and updates the gauge. A group that cannot
// be measured is left out, its error joined to the returned one; the others are measured.
func (m *LagMonitor) Measure(ctx context.Context) (map[string]map[string]int64, error) {
	c := sarama.NewConfig()
	if m.cfg.Sarama != nil {
		copied := *m.cfg.Sarama
		c = &copied
	}
	if !c.Version.IsAtLeast(sarama.V2_8_0_0) {
		c.Version = sarama.V2_8_0_0
	}
	client, err := sarama.NewClient(m.cfg.Brokers, c)
	if err != nil {
		return nil, fmt.Errorf("relay: lag: connect: %w", err)
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return nil, fmt.Errorf("relay: lag: %w", err)
	}
	// Every topic's partitions are asked for explicitly: not every broker answers a request for
	// "all topics" with the group's offsets.
	topics, err := client.Topics()
	if err != nil {
		return nil, fmt.Errorf("relay: lag: list topics: %w", err)
	}
	all := map[string][]int32{}
	for _, topic := range topics {
		if strings.HasPrefix(topic, "__") {
			continue // Kafka's own topics: offsets, transactions.
		}
		if all[topic], err = client.Partitions(topic); err != nil {
			return nil, fmt.Errorf("relay: lag: partitions of %s: %w", topic, err)
		}
	}
	// Each group on its own: one that cannot be measured (a typo, a consumer not deployed yet)
	// must not leave the others unreported.
	out := map[string]map[string]int64{}
	var failed []error
	for _, group := range m.cfg.Groups {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		lag, err := m.measureGroup(client, admin, group, all)
		if err != nil {
			failed = append(failed, fmt.Errorf("relay: lag of group %s: %w", group, err))
			continue
		}
		out[group] = lag
		for topic, n := range lag {
			m.metrics.Lag.WithLabelValues(group, topic).Set(float64(n))
		}
		m.metrics.Measured.WithLabelValues(group).SetToCurrentTime()
	}
	return out, errors.Join(failed...)
}

// measureGroup returns group's lag per topic among the partitions all, for the topics it has
// committed an offset on.
func (m *LagMonitor) measureGroup(client sarama.Client, admin sarama.ClusterAdmin, group string, all map[string][]int32) (map[string]int64, error) {
	offsets, err := admin.ListConsumerGroupOffsets(group, all)
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for topic, partitions := range offsets.Blocks {
		var lag int64
		committed := false
		for partition, block := range partitions {
			if block.Offset < 0 {
				continue
			}
			committed = true
			hw, err := client.GetOffset(topic, partition, sarama.OffsetNewest)
			if err != nil {
				return nil, fmt.Errorf("high-water mark of %s/%d: %w", topic, partition, err)
			}
			lag += max(hw-block.Offset, 0)
		}
		if committed {
			out[topic] = lag
		}
	}
	return out, nil
}

// Run measures every Interval until ctx is cancelled.
func (m *LagMonitor) Run(ctx context.Context) error {
	t := time.NewTicker(m.cfg.Interval)
	defer t.Stop()
	failing := false
	for {
		_, err := m.Measure(ctx)
		switch {
		case err != nil && ctx.Err() == nil && !failing:
			failing = true
			m.cfg.Logger.Error("could not measure consumer lag; retrying", "error", err)
		case err == nil && failing:
			failing = false
			m.cfg.Logger.Info("measuring consumer lag again")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
