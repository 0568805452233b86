package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// relaySettings are the settings of `txbox relay`.
type relaySettings struct {
	brokers, owner, txPrefix, metricsAddr, lagGroups, stripeURL     string
	shards, batchSize, batchBytes, maxPublishAttempts               int
	leaseTTL, pollInterval, idlePollInterval, statsInterval         time.Duration
	replayWindow, callTimeout, minPublishBackoff, maxPublishBackoff time.Duration
	minCallBackoff, maxCallBackoff                                  time.Duration
	transactional                                                   bool
}

func (a *app) relayCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "relay",
		Short: "publish outbox rows to Kafka and execute side-effect calls (until SIGINT or SIGTERM)",
		Long: "Publishes outbox rows to Kafka and, when " + relay.APIKeyEnvVar + " is set, executes side-effect calls,\n" +
			"under per-shard leases. Stops gracefully on SIGINT or SIGTERM. The Stripe key has no flag on\n" +
			"purpose: flags show in ps and shell history.",
		Args: usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	s := relaySettings{
		metricsAddr: "127.0.0.1:9464", stripeURL: relay.DefaultStripeURL,
		shards: relay.DefaultShards, batchSize: relay.DefaultBatchSize, batchBytes: relay.DefaultBatchBytes, transactional: true,
		leaseTTL: relay.DefaultLeaseTTL, pollInterval: relay.DefaultPollInterval, idlePollInterval: relay.DefaultIdlePollInterval,
		replayWindow:  relay.DefaultReplayWindow,
		statsInterval: relay.DefaultStatsInterval, maxPublishAttempts: relay.DefaultMaxPublishAttempts,
		minPublishBackoff: relay.DefaultMinPublishBackoff, maxPublishBackoff: relay.DefaultMaxPublishBackoff,
		minCallBackoff: relay.DefaultMinCallBackoff, maxCallBackoff: relay.DefaultMaxCallBackoff,
	}
	fs := cmd.Flags()
	f := a.setting(fs, text(&s.brokers, list(hostPort)), "kafka-brokers", "TXBOX_KAFKA_BROKERS", "comma-separated Kafka brokers, host:port")
	annotate(f, annRequired, "true")
	annotate(f, annField, "KafkaConfig.Brokers")
	f = a.setting(fs, text(&s.owner, nonEmpty), "owner", "TXBOX_RELAY_OWNER", "unique name of this relay in the lease table (default host-pid-random)")
	annotate(f, annField, "Config.Owner")
	f = a.setting(fs, text(&s.txPrefix, nonEmpty), "transactional-id-prefix", "TXBOX_TRANSACTIONAL_ID_PREFIX",
		"prefix of each shard's Kafka transactional.id: the same for every relay of an outbox, unique per outbox on a cluster; default txbox-<the outbox's identity>, which is both")
	annotate(f, annField, "KafkaConfig.TransactionalIDPrefix")
	a.setting(fs, listenAddr(&s.metricsAddr), "metrics-addr", "TXBOX_METRICS_ADDR", "address serving /metrics and /readyz; off disables both")
	a.setting(fs, text(&s.lagGroups, list(nonEmpty)), "lag-groups", "TXBOX_LAG_GROUPS", "comma-separated consumer groups whose lag is exported as txbox_consumer_lag_messages")
	f = a.setting(fs, shardsValue(&s.shards, outbox.Slots), "shards", "TXBOX_SHARDS", "number of shard leases; must divide 256 and be the same on every relay")
	annotate(f, annField, "Config.Shards")
	f = a.setting(fs, intIn(&s.batchSize, 1, 10000), "batch-size", "TXBOX_BATCH_SIZE", "rows published per batch (one Kafka transaction)")
	annotate(f, annField, "Config.BatchSize")
	f = a.setting(fs, intIn(&s.batchBytes, 1<<10, 1<<30), "batch-bytes", "TXBOX_BATCH_BYTES", "most payload and metadata bytes per batch; a larger message goes alone")
	annotate(f, annField, "Config.BatchBytes")
	f = a.setting(fs, durationIn(&s.leaseTTL, time.Second, 10*time.Minute), "lease-ttl", "TXBOX_LEASE_TTL", "lease lifetime; a dead relay's shards move within about this long")
	annotate(f, annField, "Config.LeaseTTL")
	f = a.setting(fs, durationIn(&s.pollInterval, time.Millisecond, time.Minute), "poll-interval", "TXBOX_POLL_INTERVAL", "shortest wait between looks for new rows, while rows keep coming (publish latency under load)")
	annotate(f, annField, "Config.PollInterval")
	f = a.setting(fs, durationIn(&s.idlePollInterval, time.Millisecond, time.Minute), "idle-poll-interval", "TXBOX_IDLE_POLL_INTERVAL", "longest wait between looks, reached while nothing comes (first message's latency, idle cost); at least --poll-interval, which is its default when longer than 25ms")
	annotate(f, annField, "Config.IdlePollInterval")
	f = a.setting(fs, durationIn(&s.statsInterval, time.Second, time.Hour), "stats-interval", "TXBOX_STATS_INTERVAL", "how often the backlog and dead-letter gauges are refreshed")
	annotate(f, annField, "Config.StatsInterval")
	f = a.setting(fs, intIn(&s.maxPublishAttempts, 1, 1000), "max-publish-attempts", "TXBOX_MAX_PUBLISH_ATTEMPTS", "attempts of a message the broker refuses for a reason that may pass (unknown topic, no write permission) before it goes to the DLQ")
	annotate(f, annField, "Config.MaxPublishAttempts")
	f = a.setting(fs, durationIn(&s.minPublishBackoff, time.Millisecond, 24*time.Hour), "min-publish-backoff", "TXBOX_MIN_PUBLISH_BACKOFF", "first wait before a refused message is tried again (exponential, with jitter)")
	annotate(f, annField, "Config.MinPublishBackoff")
	f = a.setting(fs, durationIn(&s.maxPublishBackoff, time.Millisecond, 24*time.Hour), "max-publish-backoff", "TXBOX_MAX_PUBLISH_BACKOFF", "longest wait before a refused message is tried again")
	annotate(f, annField, "Config.MaxPublishBackoff")
	a.setting(fs, boolValue(&s.transactional), "transactional", "TXBOX_TRANSACTIONAL", "publish each batch as a Kafka transaction, fencing relays that lost their lease; --transactional=false (with the =) = idempotent producer only").NoOptDefVal = "true"
	f = a.setting(fs, text(&s.stripeURL, httpURL), "stripe-base-url", "TXBOX_STRIPE_BASE_URL", "Stripe API address for side-effect calls, which run when "+relay.APIKeyEnvVar+" is set")
	annotate(f, annField, "CallConfig.BaseURL")
	f = a.setting(fs, durationIn(&s.replayWindow, time.Minute, 24*time.Hour-time.Minute), "call-replay-window", "TXBOX_CALL_REPLAY_WINDOW", "oldest first attempt a call may have when sent; older calls go to the DLQ for reconciliation (below 24h)")
	annotate(f, annField, "CallConfig.ReplayWindow")
	f = a.setting(fs, durationIn(&s.callTimeout, 100*time.Millisecond, 10*time.Minute), "call-timeout", "TXBOX_CALL_TIMEOUT", "timeout of one side-effect request, at most --lease-ttl (default two thirds of --lease-ttl)")
	annotate(f, annField, "CallConfig.Timeout")
	f = a.setting(fs, durationIn(&s.minCallBackoff, time.Millisecond, time.Hour), "min-call-backoff", "TXBOX_MIN_CALL_BACKOFF", "first wait before a failed side-effect call is sent again (exponential, with jitter, never sooner than the provider's Retry-After); calls of one partition key wait behind it")
	annotate(f, annField, "CallConfig.MinBackoff")
	f = a.setting(fs, durationIn(&s.maxCallBackoff, time.Millisecond, 24*time.Hour), "max-call-backoff", "TXBOX_MAX_CALL_BACKOFF", "longest wait before a failed side-effect call is sent again")
	annotate(f, annField, "CallConfig.MaxBackoff")

	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		// A setting whose default follows another's, as in relay.Config, follows it here too
		// unless given: before, --poll-interval 50ms alone was refused for the idle interval's 25ms.
		for _, follows := range []struct {
			name       string
			v, atLeast *time.Duration
		}{
			{"idle-poll-interval", &s.idlePollInterval, &s.pollInterval},
			{"max-publish-backoff", &s.maxPublishBackoff, &s.minPublishBackoff},
			{"max-call-backoff", &s.maxCallBackoff, &s.minCallBackoff},
		} {
			if !cmd.Flags().Changed(follows.name) {
				*follows.v = max(*follows.v, *follows.atLeast)
			}
		}
		if s.callTimeout == 0 {
			s.callTimeout = s.leaseTTL * 2 / 3
		} else if s.callTimeout > s.leaseTTL {
			return usagef("%s (%s) must not be longer than %s (%s): a graceful handover waits one lease TTL for the calls in flight",
				refOf(cmd, "call-timeout"), formatDuration(s.callTimeout), refOf(cmd, "lease-ttl"), formatDuration(s.leaseTTL))
		}
		if s.maxCallBackoff < s.minCallBackoff {
			// Checked here, not only by CallConfig, so that a bad pair is refused before the
			// Stripe key is set, not on the first start with it.
			return usagef("%s (%s) must be at least %s (%s)", refOf(cmd, "max-call-backoff"), formatDuration(s.maxCallBackoff),
				refOf(cmd, "min-call-backoff"), formatDuration(s.minCallBackoff))
		}
		sink, err := relay.NewKafkaSink(relay.KafkaConfig{
			Brokers: splitList(s.brokers), Transactional: &s.transactional, TransactionalIDPrefix: s.txPrefix,
		})
		if err != nil {
			return usagef("%v", fieldNames(cmd, err))
		}
		var calls *relay.CallConfig
		if key := a.getenv(relay.APIKeyEnvVar); key != "" {
			calls = &relay.CallConfig{APIKey: key, BaseURL: s.stripeURL, ReplayWindow: s.replayWindow, Timeout: s.callTimeout,
				MinBackoff: s.minCallBackoff, MaxBackoff: s.maxCallBackoff}
		}
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		cfg := relay.Config{
			Sink: sink, Schema: d.schema, Owner: s.owner, Shards: s.shards, BatchSize: s.batchSize, BatchBytes: s.batchBytes,
			LeaseTTL: s.leaseTTL, PollInterval: s.pollInterval, IdlePollInterval: s.idlePollInterval, StatsInterval: s.statsInterval,
			Calls:              calls,
			MaxPublishAttempts: s.maxPublishAttempts, MinPublishBackoff: s.minPublishBackoff, MaxPublishBackoff: s.maxPublishBackoff,
			Logger: a.log, Registerer: reg,
		}
		pool, err := d.connect(ctx)
		if err != nil {
			return err
		}
		// A connection stuck on a database path that hangs (rather than refuses) would keep the
		// process from exiting after a graceful stop: give up on it after one TTL.
		defer a.closeWithin(pool, s.leaseTTL)
		cfg.DB = pool
		r, err := relay.New(cfg)
		if err != nil {
			return usagef("%v", fieldNames(cmd, err))
		}
		resolved := []any{"owner", r.Owner(), "side_effect_calls", calls != nil}
		if s.txPrefix == "" && s.transactional {
			// Derived once the relay reads the outbox; its "relay started" line gives it.
			resolved = append(resolved, "transactional_id_prefix", "the outbox's default (txbox-<its identity>)")
		}
		a.logStart(cmd, resolved...)
		if calls == nil {
			a.log.Info("side-effect calls are not executed: " + relay.APIKeyEnvVar + " is not set")
		}
		if s.metricsAddr != "" {
			stop, err := a.serveMetrics(s.metricsAddr, reg, r.Ready)
			if err != nil {
				return err
			}
			defer stop()
		}
		if s.lagGroups != "" {
			mon, err := relay.NewLagMonitor(relay.LagConfig{
				Brokers: splitList(s.brokers), Groups: splitList(s.lagGroups), Registerer: reg, Logger: a.log,
			})
			if err != nil {
				return fmt.Errorf("%s: %w", refOf(cmd, "lag-groups"), err)
			}
			go func() { _ = mon.Run(ctx) }()
		}
		return fieldNames(cmd, r.Run(ctx))
	}
	return cmd
}

// warnBeyondLoopback logs warning when ln accepts connections from other hosts: it was configured
// so, since every listener of txbox binds to loopback by default.
func (a *app) warnBeyondLoopback(ln net.Listener, warning string) {
	if host, _, _ := net.SplitHostPort(ln.Addr().String()); !net.ParseIP(host).IsLoopback() {
		a.log.Warn(warning, "addr", ln.Addr().String())
	}
}

// serveMetrics serves /metrics, and ready's verdict at /readyz (503 with its error, which names
// no secret), on addr until stop is called.
func (a *app) serveMetrics(addr string, reg *prometheus.Registry, ready func() error) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ready\n")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("metrics server stopped", "error", err)
		}
	}()
	a.warnBeyondLoopback(ln, "metrics are served beyond loopback: anyone who reaches the address can read them")
	a.log.Info("serving metrics", "addr", "http://"+ln.Addr().String()+"/metrics")
	return func() { _ = srv.Close() }, nil
}
