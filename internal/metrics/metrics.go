// Package metrics defines txbox's Prometheus collectors. The names are part of txbox's API (see the
// README); every collector is prefixed txbox_.
package metrics

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
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

// deadLetters is shared by every component that gives up on messages.
func deadLetters(reg prometheus.Registerer) *prometheus.CounterVec {
	return register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "txbox_dead_letters_total",
		Help: "Messages moved to the dead-letter table, by source and reason.",
	}, []string{"source", "reason"}))
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
func NewInbox(reg prometheus.Registerer) *Inbox {
	return &Inbox{
		DedupChecks: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_dedup_checks_total",
			Help: "Messages checked against the inbox. dedup_hits_total / dedup_checks_total is the dedup hit rate, about 0 in steady state.",
		}, []string{"consumer"})),
		DedupHits: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_dedup_hits_total",
			Help: "Messages recognised as already processed (or dead) and skipped without calling the handler.",
		}, []string{"consumer"})),
		Attempts: register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "txbox_retry_count",
			Help:    "Delivery attempts a message needed before it was processed or given up on.",
			Buckets: []float64{1, 2, 3, 5, 8, 13, 21},
		}, []string{"consumer"})),
		DeadLetters: deadLetters(reg),
		SupersededTokens: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_superseded_token_messages_total",
			Help: "Messages that arrived with a lower fencing token than one already seen on the same shard, topic and partition: copies from a relay that lost its lease.",
		}, []string{"consumer"})),
	}
}

// Relay holds the relay's collectors.
type Relay struct {
	Published     prometheus.Counter
	Fenced        prometheus.Counter
	ShardsHeld    prometheus.Gauge
	Backlog       prometheus.Gauge
	OldestPending prometheus.Gauge
	DLQDepth      *prometheus.GaugeVec
	DLQAge        *prometheus.GaugeVec
	DeadLetters   *prometheus.CounterVec
	PublishErrors prometheus.Counter
}

// NewRelay creates (or finds) the relay collectors in reg; a nil reg keeps them unregistered.
func NewRelay(reg prometheus.Registerer) *Relay {
	return &Relay{
		Published: register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "txbox_relay_published_total",
			Help: "Outbox messages published and completed.",
		})),
		Fenced: register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "txbox_fenced_rejections_total",
			Help: "Times this relay found its lease superseded (by the database or the broker) and dropped a shard: zombie work refused.",
		})),
		ShardsHeld: register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "txbox_relay_shards_held",
			Help: "Shard leases this relay holds.",
		})),
		Backlog: register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "txbox_outbox_backlog",
			Help: "Outbox rows not yet published or executed.",
		})),
		OldestPending: register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "txbox_outbox_oldest_pending_seconds",
			Help: "Age of the oldest outbox row not yet published or executed.",
		})),
		DLQDepth: register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "txbox_dlq_depth",
			Help: "Dead letters waiting for a person, by source. Alert on any non-zero value.",
		}, []string{"source"})),
		DLQAge: register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "txbox_dlq_age_seconds",
			Help: "Age of the oldest dead letter, by source. Alert over one hour.",
		}, []string{"source"})),
		DeadLetters: deadLetters(reg),
		PublishErrors: register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "txbox_relay_publish_errors_total",
			Help: "Batches whose publish failed and will be retried.",
		})),
	}
}

// Calls holds the collectors of the relay's side-effect calls.
type Calls struct {
	// Duration is the time of each request to the provider, by outcome. Its p99 must stay below the
	// relay's lease TTL.
	Duration *prometheus.HistogramVec
	// Results counts requests by what the relay did with their outcome.
	Results *prometheus.CounterVec
	// IdempotencyErrors counts calls whose key the provider had seen with other parameters: each one
	// is a bug (two calls sharing a name, a handler whose request changes between deliveries) and
	// a dead letter. Alert on any increase.
	IdempotencyErrors prometheus.Counter
	// InFlight is the number of requests waiting for the provider's answer.
	InFlight prometheus.Gauge
}

// NewCalls creates (or finds) the call collectors in reg; a nil reg keeps them unregistered.
func NewCalls(reg prometheus.Registerer) *Calls {
	return &Calls{
		Duration: register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "txbox_side_effect_duration_seconds",
			Help:    "Duration of each side-effect request, by outcome. Its p99 must stay below the relay's lease TTL.",
			Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60},
		}, []string{"outcome"})),
		Results: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_side_effect_calls_total",
			Help: "Side-effect requests by result: succeeded, declined, rejected (done); retry; dead (dead-lettered); abandoned (lease lost mid-call).",
		}, []string{"result"})),
		IdempotencyErrors: register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "txbox_side_effect_idempotency_errors_total",
			Help: "Calls the provider refused because their idempotency key was used with other parameters; each is dead-lettered. Alert on any increase.",
		})),
		InFlight: register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "txbox_side_effect_calls_in_flight",
			Help: "Side-effect requests waiting for the provider's answer.",
		})),
	}
}

// NewConsumerLag creates (or finds) the consumer lag gauge in reg.
func NewConsumerLag(reg prometheus.Registerer) *prometheus.GaugeVec {
	return register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "txbox_consumer_lag_messages",
		Help: "Messages published to a topic and not yet committed by a consumer group: high-water mark minus committed offset, summed over the topic's partitions.",
	}, []string{"group", "topic"}))
}
