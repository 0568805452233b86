package relay_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/stripetest"
)

// scrape reads url the way Prometheus does and returns the families by name.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	res, err := http.Get(url)
	require.NoError(t, err)
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(res.Body)
	require.NoError(t, err)
	return families
}

// series finds the series of name whose labels include labels; nil when there is none.
func series(families map[string]*dto.MetricFamily, name string, labels map[string]string) *dto.Metric {
	f := families[name]
	if f == nil {
		return nil
	}
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, lp := range m.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		for k, v := range labels {
			if have[k] != v {
				continue next
			}
		}
		return m
	}
	return nil
}

// value is a counter's or a gauge's value; -1 when the series does not exist.
func value(families map[string]*dto.MetricFamily, name string, labels map[string]string) float64 {
	m := series(families, name, labels)
	switch {
	case m == nil:
		return -1
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Untyped != nil:
		return m.GetUntyped().GetValue()
	}
	return -1
}

// Known duplicates, retries and one dead letter, driven through the real relay (Kafka, Stripe
// double) and the real inbox, read back from /metrics over HTTP under the README's names.
//
// Three messages are published once and consumed by two consumer groups of one inbox consumer and
// handler, so every message is delivered twice, the second time as a duplicate:
//   - m1 is processed, and its handler enqueues a charge, which fails once (a 500) and succeeds on
//     the retry.
//   - m2's handler fails the first time; the redelivery processes it at attempt 2.
//   - m3 is unprocessable: one dead letter.
//
// So: 7 checks, 3 hits, 2 messages processed with 1 and 2 attempts, 1 inbox dead letter, 3 rows
// published, 1 call retried then succeeded.
func TestMetricsEndpointCountsWhatHappened(t *testing.T) {
	t.Parallel()
	b := setup(t)
	reg := prometheus.NewRegistry()
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	t.Cleanup(srv.Close)

	double := stripetest.New(stripetest.Options{})
	t.Cleanup(double.Close)
	double.Inject(stripetest.Fault{Kind: stripetest.Fault500, Count: 1})
	const shards = 2
	b.startRelay(t, func(c *relay.Config) {
		c.Registerer = reg
		c.Shards = shards
		c.StatsInterval = 50 * time.Millisecond
		c.Calls = &relay.CallConfig{
			APIKey: stripetest.TestKey, BaseURL: double.URL(),
			HTTPClient: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}},
			MinBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, PollInterval: 10 * time.Millisecond,
		}
	})

	ib, err := inbox.New(inbox.Config{DB: b.env.Pool, Consumer: "billing", Schema: b.env.Schema,
		Delivery: kafkasub.Delivery, Registerer: reg}, nil)
	require.NoError(t, err)
	ids := map[string]string{"m1": watermill.NewUUID(), "m2": watermill.NewUUID(), "m3": watermill.NewUUID()}
	var m2Failed atomic.Bool
	var settled atomic.Int64 // deliveries the handler saw through to an outcome (not the failure)
	handler := func(msg *message.Message) error {
		switch msg.UUID {
		case ids["m1"]:
			tx, _ := inbox.TxFromContext(msg.Context())
			_, err := b.writer.Call(msg.Context(), tx, outbox.Call{Name: "charge", Path: "/v1/charges",
				Params: url.Values{"amount": {"500"}, "currency": {"eur"}, "source": {"tok_visa"}}})
			return err
		case ids["m2"]:
			if m2Failed.CompareAndSwap(false, true) {
				return errors.New("the first attempt fails")
			}
		case ids["m3"]:
			return fmt.Errorf("%w: cannot be processed", inbox.ErrUnprocessable)
		}
		return nil
	}
	counted := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				settled.Add(1)
			}
			return out, err
		}
	}
	// Group a consumes first, group b once a has settled everything: b's deliveries are all
	// duplicates, and the attempts a needed do not depend on how the groups interleave.
	startGroup := func(group string) {
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddMiddleware(counted, ib.Middleware)
		router.AddConsumerHandler("charge", b.topic, kafkatest.NewSubscriber(t, group+"-"+b.env.Schema), handler)
		txtest.RunRouter(t, router)
	}
	startGroup("a")

	tx, err := b.env.Pool.Begin(context.Background())
	require.NoError(t, err)
	for _, name := range []string{"m1", "m2", "m3"} {
		require.NoError(t, b.writer.Publish(context.Background(), tx, b.topic, message.NewMessage(ids[name], []byte(`{}`))))
	}
	require.NoError(t, tx.Commit(context.Background()))
	require.Eventually(t, func() bool { return settled.Load() == 3 }, 60*time.Second, 20*time.Millisecond, "group a settles the three messages")
	startGroup("b")

	of := map[string]string{"schema": b.env.Schema}
	inboxDLQ := map[string]string{"schema": b.env.Schema, "source": "inbox"}
	require.Eventually(t, func() bool {
		m := scrape(t, srv.URL)
		return settled.Load() == 6 && // every delivery settled: 2 per message
			value(m, "txbox_side_effect_calls_total", map[string]string{"schema": b.env.Schema, "result": "succeeded"}) == 1 &&
			value(m, "txbox_dlq_depth", inboxDLQ) == 1 && value(m, "txbox_outbox_backlog", of) == 0
	}, 60*time.Second, 50*time.Millisecond, "every delivery settled, the call done, the gauges refreshed")

	m := scrape(t, srv.URL)
	scope := map[string]string{"consumer": "billing", "handler": "charge"}
	require.Equal(t, 7.0, value(m, "txbox_dedup_checks_total", scope), "checks")
	require.Equal(t, 3.0, value(m, "txbox_dedup_hits_total", scope), "hits")
	retries := series(m, "txbox_retry_count", scope)
	require.NotNil(t, retries)
	require.Equal(t, uint64(2), retries.GetHistogram().GetSampleCount(), "messages processed")
	require.Equal(t, 3.0, retries.GetHistogram().GetSampleSum(), "attempts they needed: 1 and 2")
	require.Equal(t, 1.0, value(m, "txbox_dead_letters_total",
		map[string]string{"schema": b.env.Schema, "source": "inbox", "reason": inbox.ReasonUnprocessable}))
	require.Equal(t, 1.0, value(m, "txbox_dlq_depth", inboxDLQ))
	require.Equal(t, 0.0, value(m, "txbox_dlq_depth", map[string]string{"schema": b.env.Schema, "source": "relay"}))
	require.Equal(t, 3.0, value(m, "txbox_relay_published_total", of))
	require.Equal(t, 0.0, value(m, "txbox_relay_publish_errors_total", of))
	require.Equal(t, 0.0, value(m, "txbox_fenced_rejections_total", of))
	require.Equal(t, float64(shards), value(m, "txbox_relay_shards_held", of))
	require.Equal(t, 2.0, value(m, "txbox_relay_lease_ttl_seconds", of))
	require.Equal(t, 0.0, value(m, "txbox_outbox_backlog", of))
	call := func(result string) float64 {
		return value(m, "txbox_side_effect_calls_total", map[string]string{"schema": b.env.Schema, "result": result})
	}
	require.Equal(t, 1.0, call("retry"), "the 500 is retried")
	require.Equal(t, 1.0, call("succeeded"))
	require.Equal(t, 0.0, value(m, "txbox_side_effect_idempotency_errors_total", of))
	var sends uint64
	for _, s := range m["txbox_side_effect_duration_seconds"].GetMetric() {
		sends += s.GetHistogram().GetSampleCount()
	}
	require.Equal(t, uint64(2), sends, "two requests timed")
	require.Equal(t, 1, double.TotalCharges())
}
