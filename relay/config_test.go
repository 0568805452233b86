package relay_test

import (
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/stripetest"
)

// Every duration and number of the configurations is checked in the constructor: zero means the
// documented default, a negative or absurd value is an error that names the field, never a panic
// later (a negative StatsInterval used to reach time.NewTicker).
func TestConfigValidation(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	calls := func(mutate func(*relay.CallConfig)) func(*relay.Config) {
		return func(c *relay.Config) {
			c.Calls = &relay.CallConfig{APIKey: stripetest.TestKey}
			mutate(c.Calls)
		}
	}
	for _, tc := range []struct {
		field  string
		mutate func(*relay.Config)
	}{
		{"Config.Shards", func(c *relay.Config) { c.Shards = -1 }},
		{"Config.Shards", func(c *relay.Config) { c.Shards = 3 }},
		{"Config.LeaseTTL", func(c *relay.Config) { c.LeaseTTL = -time.Second }},
		{"Config.LeaseTTL", func(c *relay.Config) { c.LeaseTTL = time.Millisecond }},
		{"Config.LeaseTTL", func(c *relay.Config) { c.LeaseTTL = 24 * time.Hour }},
		{"Config.BatchSize", func(c *relay.Config) { c.BatchSize = -1 }},
		{"Config.BatchSize", func(c *relay.Config) { c.BatchSize = 1 << 20 }},
		{"Config.PollInterval", func(c *relay.Config) { c.PollInterval = -time.Millisecond }},
		{"Config.PollInterval", func(c *relay.Config) { c.PollInterval = time.Hour }},
		{"Config.PollInterval", func(c *relay.Config) { c.PollInterval = time.Nanosecond }},
		{"Config.Owner", func(c *relay.Config) { c.Owner = "relay\x00a" }},
		{"CallConfig.APIKey", calls(func(c *relay.CallConfig) { c.APIKey = "pk_live_publishable" })},
		{"Config.StatsInterval", func(c *relay.Config) { c.StatsInterval = -time.Second }},
		{"Config.StatsInterval", func(c *relay.Config) { c.StatsInterval = 48 * time.Hour }},
		{"Config.StatsInterval", func(c *relay.Config) { c.StatsInterval = time.Nanosecond }},
		{"Config.MaxPublishAttempts", func(c *relay.Config) { c.MaxPublishAttempts = -1 }},
		{"Config.MinPublishBackoff", func(c *relay.Config) { c.MinPublishBackoff = -time.Second }},
		{"Config.MinPublishBackoff", func(c *relay.Config) { c.MinPublishBackoff = time.Nanosecond }},
		{"Config.MaxPublishBackoff", func(c *relay.Config) { c.MaxPublishBackoff = -time.Second }},
		{"Config.MaxPublishBackoff", func(c *relay.Config) { c.MinPublishBackoff, c.MaxPublishBackoff = time.Minute, time.Second }},
		{"Config.MaxPublishBackoff", func(c *relay.Config) { c.MaxPublishBackoff = 48 * time.Hour }},
		{"CallConfig.Timeout", calls(func(c *relay.CallConfig) { c.Timeout = -time.Second })},
		{"CallConfig.Timeout", calls(func(c *relay.CallConfig) { c.Timeout = 48 * time.Hour })},
		{"CallConfig.ReplayWindow", calls(func(c *relay.CallConfig) { c.ReplayWindow = -time.Hour })},
		{"CallConfig.ReplayWindow", calls(func(c *relay.CallConfig) { c.ReplayWindow = 24 * time.Hour })},
		{"CallConfig.MinBackoff", calls(func(c *relay.CallConfig) { c.MinBackoff = -time.Second })},
		{"CallConfig.MinBackoff", calls(func(c *relay.CallConfig) { c.MinBackoff = time.Nanosecond })},
		{"CallConfig.MaxBackoff", calls(func(c *relay.CallConfig) { c.MaxBackoff = -time.Second })},
		{"CallConfig.MaxBackoff", calls(func(c *relay.CallConfig) { c.MinBackoff, c.MaxBackoff = time.Minute, time.Second })},
		{"CallConfig.BatchSize", calls(func(c *relay.CallConfig) { c.BatchSize = -1 })},
		{"CallConfig.Concurrency", calls(func(c *relay.CallConfig) { c.Concurrency = -1 })},
		{"CallConfig.PollInterval", calls(func(c *relay.CallConfig) { c.PollInterval = -time.Second })},
		{"CallConfig.PollInterval", calls(func(c *relay.CallConfig) { c.PollInterval = time.Hour })},
		{"CallConfig.PollInterval", calls(func(c *relay.CallConfig) { c.PollInterval = time.Nanosecond })},
		{"CallConfig.MaxResultBytes", calls(func(c *relay.CallConfig) { c.MaxResultBytes = -1 })},
		{"CallConfig.BaseURL", calls(func(c *relay.CallConfig) { c.BaseURL = "api.stripe.com" })},
	} {
		cfg := relay.Config{DB: env.Pool, Sink: &memSink{}, Schema: env.Schema}
		tc.mutate(&cfg)
		_, err := relay.New(cfg)
		require.ErrorContains(t, err, tc.field, "%+v", cfg)
	}

	_, err := relay.New(relay.Config{DB: env.Pool, Sink: &memSink{}, Schema: env.Schema, Calls: &relay.CallConfig{APIKey: stripetest.TestKey}})
	require.NoError(t, err, "zero values mean the defaults")

	for _, tc := range []struct {
		field string
		cfg   relay.KafkaConfig
	}{
		{"KafkaConfig.Brokers", relay.KafkaConfig{}},
		{"KafkaConfig.Brokers", relay.KafkaConfig{Brokers: []string{"127.0.0.1:9092", ""}}},
		{"KafkaConfig.Brokers", relay.KafkaConfig{Brokers: []string{"localhost"}}},
		{"KafkaConfig.Brokers", relay.KafkaConfig{Brokers: []string{" k1:9092"}}},
		{"KafkaConfig.TransactionalIDPrefix", relay.KafkaConfig{Brokers: []string{"127.0.0.1:9092"}, TransactionalIDPrefix: "with\nnewline"}},
		{"KafkaConfig.Sarama", relay.KafkaConfig{Brokers: []string{"127.0.0.1:9092"}, Sarama: func() *sarama.Config {
			c := sarama.NewConfig()
			c.Net.DialTimeout = -time.Second
			return c
		}()}},
	} {
		_, err := relay.NewKafkaSink(tc.cfg)
		require.ErrorContains(t, err, tc.field, "%+v", tc.cfg)
	}
	_, err = relay.NewKafkaSink(relay.KafkaConfig{Brokers: []string{"127.0.0.1:9092"}})
	require.NoError(t, err)
}
