// Package metrics defines txbox's Prometheus collectors. The names are part of txbox's API (see the
// README); every collector is prefixed txbox_.
package metrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/txbox/txbox/internal/sqlname"
)

// register registers c with reg, or returns the collector already registered under the same
// description, so that several components (two inbox middlewares, say) can share one registry.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if reg == nil {
		return c
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		panic(err) // Same name, different shape: a programming error inside txbox.
	}
	return c
}

// ofSchema is the label set of a component's series: the schema of its tables, as configured ("" is
// the default schema).
func ofSchema(schema string) prometheus.Labels {
	if schema == "" {
		schema = sqlname.DefaultSchema
	}
	return prometheus.Labels{"schema": schema}
}

// deadLetters is shared by every component that gives up on messages, curried with the schema
// of the component's tables.
func deadLetters(reg prometheus.Registerer, schema string) *prometheus.CounterVec {
	return register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "txbox_dead_letters_total",
		Help: "Messages moved to the dead-letter table, by schema, source and reason.",
	}, []string{"schema", "source", "reason"})).MustCurryWith(ofSchema(schema))
}

// Inbox holds the consumer-side collectors.
type Inbox struct {
	DedupChecks      *prometheus.CounterVec
	DedupHits        *prometheus.CounterVec
	Attempts         *prometheus.HistogramVec
	DeadLetters      *prometheus.CounterVec
	SupersededTokens *prometheus.CounterVec
}

// NewInbox creates (or finds) the inbox collectors in reg; a nil reg keeps them unregistered.
// schema is the schema of the inbox's tables, a label of its dead letters.
func NewInbox(reg prometheus.Registerer, schema string) *Inbox {
	return &Inbox{
		DedupChecks: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_dedup_checks_total",
			Help: "Messages checked against the inbox. dedup_hits_total / dedup_checks_total is the dedup hit rate, about 0 in steady state.",
		}, []string{"consumer", "handler"})),
		DedupHits: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_dedup_hits_total",
			Help: "Messages recognised as already processed (or dead) and skipped without calling the handler.",
		}, []string{"consumer", "handler"})),
		Attempts: register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "txbox_retry_count",
			Help:    "Delivery attempts a message needed before it was processed or given up on.",
			Buckets: []float64{1, 2, 3, 5, 8, 13, 21},
		}, []string{"consumer", "handler"})),
		DeadLetters: deadLetters(reg, schema),
		SupersededTokens: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_superseded_token_messages_total",
			Help: "Messages that arrived with a lower fencing token than one already seen on the same shard, topic and partition: copies from a relay that lost its lease.",
		}, []string{"consumer"})),
	}
}

// Relay holds the relay's collectors, each one curried with the schema of the outbox the relay
// serves.
//
// Why a schema label: two relays in one process serve two outboxes, which only differ by schema,
// and their series must stay apart. Relays in different processes are already told apart by the
// scrape's instance label, and the relay's owner name would start a new series on every restart.
// Two relays of one schema in one process add up: counters sum, ShardsHeld is counted up and down
// rather than set, and the outbox and dead-letter gauges measure the same tables.
type Relay struct {
	Published     prometheus.Counter
	PublishErrors prometheus.Counter
	Fenced        prometheus.Counter
	// ShardsHeld is incremented when a lease is taken and decremented when it is given up or lost.
	ShardsHeld prometheus.Gauge
	// LeaseTTL is the relay's Config.LeaseTTL in seconds, for comparing call durations with it.
	LeaseTTL      prometheus.Gauge
	Backlog       prometheus.Gauge
	OldestPending prometheus.Gauge
	// StatsTime is when the backlog and dead-letter gauges were last refreshed, as a Unix time.
	StatsTime   prometheus.Gauge
	DLQDepth    *prometheus.GaugeVec
	DLQAge      *prometheus.GaugeVec
	DeadLetters *prometheus.CounterVec
}

// NewRelay creates (or finds) the relay collectors in reg for the relay of schema; a nil reg keeps
// them unregistered.
func NewRelay(reg prometheus.Registerer, schema string) *Relay {
	of := ofSchema(schema)
	counter := func(name, help string) prometheus.Counter {
		return register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"schema"})).With(of)
	}
	gauge := func(name, help string) prometheus.Gauge {
		return register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, []string{"schema"})).With(of)
	}
	bySource := func(name, help string) *prometheus.GaugeVec {
		return register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, []string{"schema", "source"})).MustCurryWith(of)
	}
	return &Relay{
		Published: counter("txbox_relay_published_total",
			"Outbox messages published and completed."),
		PublishErrors: counter("txbox_relay_publish_errors_total",
			"Batches whose publish failed and will be retried."),
		Fenced: counter("txbox_fenced_rejections_total",
			"Times a relay found its lease superseded (by the database or the broker) and dropped a shard: zombie work refused."),
		ShardsHeld: gauge("txbox_relay_shards_held",
			"Shard leases the relays of this process hold. Alert when no relay holds any."),
		LeaseTTL: gauge("txbox_relay_lease_ttl_seconds",
			"The relay's lease TTL: side-effect calls should take well under it (compare txbox_side_effect_duration_seconds)."),
		Backlog: gauge("txbox_outbox_backlog",
			"Outbox rows (messages and calls) not yet published or executed: exact up to 100,000, estimated from the table's size beyond."),
		OldestPending: gauge("txbox_outbox_oldest_pending_seconds",
			"Age of the oldest outbox row not yet published or executed."),
		StatsTime: gauge("txbox_relay_stats_timestamp_seconds",
			"When the outbox and dead-letter gauges were last measured (Unix time): they are refreshed every StatsInterval."),
		DLQDepth: bySource("txbox_dlq_depth",
			"Dead letters waiting for a person, by source. Alert on any non-zero value."),
		DLQAge: bySource("txbox_dlq_age_seconds",
			"Age of the oldest dead letter, by source. Alert over one hour."),
		DeadLetters: deadLetters(reg, schema),
	}
}

// Calls holds the collectors of the relay's side-effect calls, curried with the relay's schema.
type Calls struct {
	// Duration is the time of each request to the provider, by outcome. Its p99 must stay below the
	// relay's lease TTL.
	Duration prometheus.ObserverVec
	// Results counts requests by what the relay did with their outcome.
	Results *prometheus.CounterVec
	// IdempotencyErrors counts calls whose key the provider had seen with other parameters: each one
	// is a bug (two calls sharing a name, a handler whose request changes between deliveries) and
	// a dead letter. Alert on any increase.
	IdempotencyErrors prometheus.Counter
	// InFlight is the number of requests waiting for the provider's answer.
	InFlight prometheus.Gauge
}

// NewCalls creates (or finds) the call collectors in reg for the relay of schema; a nil reg keeps
// them unregistered.
func NewCalls(reg prometheus.Registerer, schema string) *Calls {
	of := ofSchema(schema)
	return &Calls{
		Duration: register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "txbox_side_effect_duration_seconds",
			Help: "Duration of each side-effect request, by outcome. Its p99 must stay below the relay's lease TTL.",
			// Up to the longest lease TTL the relay accepts (10m), so the p99-above-TTL alert can fire for any TTL.
			Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600},
		}, []string{"schema", "outcome"})).MustCurryWith(of),
		Results: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_side_effect_calls_total",
			Help: "Side-effect requests by result: succeeded, declined, rejected (done); retry; dead (dead-lettered); abandoned (lease lost mid-call).",
		}, []string{"schema", "result"})).MustCurryWith(of),
		IdempotencyErrors: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_side_effect_idempotency_errors_total",
			Help: "Calls the provider refused because their idempotency key was used with other parameters; each is dead-lettered. Alert on any increase.",
		}, []string{"schema"})).With(of),
		InFlight: register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "txbox_side_effect_calls_in_flight",
			Help: "Side-effect requests waiting for the provider's answer.",
		}, []string{"schema"})).With(of),
	}
}

// ConsumerLag are the gauges of relay.LagMonitor.
type ConsumerLag struct {
	Lag *prometheus.GaugeVec
	// Measured tells a lag that is still true from one left over from the last measurement that
	// succeeded: a gauge keeps its value while the group cannot be measured.
	Measured *prometheus.GaugeVec
}

// NewConsumerLag creates (or finds) the consumer lag gauges in reg.
func NewConsumerLag(reg prometheus.Registerer) *ConsumerLag {
	return &ConsumerLag{
		Lag: register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "txbox_consumer_lag_messages",
			Help: "Messages published to a topic and not yet committed by a consumer group: high-water mark minus committed offset, summed over the topic's partitions.",
		}, []string{"group", "topic"})),
		Measured: register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "txbox_consumer_lag_timestamp_seconds",
			Help: "When the group's lag was last measured (Unix time); txbox_consumer_lag_messages keeps its last value while it cannot be.",
		}, []string{"group"})),
	}
}
