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
		DeadLetters: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_dead_letters_total",
			Help: "Messages moved to the dead-letter table, by reason.",
		}, []string{"source", "reason"})),
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
		DeadLetters: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "txbox_dead_letters_total",
			Help: "Messages moved to the dead-letter table, by reason.",
		}, []string{"source", "reason"})),
		PublishErrors: register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "txbox_relay_publish_errors_total",
			Help: "Batches whose publish failed and will be retried.",
		})),
	}
}
