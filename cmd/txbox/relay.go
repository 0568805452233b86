package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/txbox/txbox/relay"
)

// relayFlags are the settings of `txbox relay`.
type relayFlags struct {
	dsn, schema, brokers, owner, txPrefix, metricsAddr, lagGroups string
	shards, batchSize                                             intValue
	leaseTTL, pollInterval                                        durationValue
	transactional                                                 boolValue
	stripeURL                                                     string
	replayWindow, callTimeout                                     durationValue
}

func runRelay(ctx context.Context, args []string, _ io.Writer) error {
	f := newFlags("relay", "relay [flags]")
	s := relayFlags{
		shards: intValue(relay.DefaultShards), batchSize: intValue(relay.DefaultBatchSize),
		leaseTTL: durationValue(relay.DefaultLeaseTTL), pollInterval: durationValue(relay.DefaultPollInterval),
		transactional: true, replayWindow: durationValue(relay.DefaultReplayWindow),
	}
	f.database(&s.dsn, &s.schema)
	f.stringEnv(&s.brokers, "kafka-brokers", "TXBOX_KAFKA_BROKERS", "", "comma-separated Kafka brokers")
	f.stringEnv(&s.owner, "owner", "TXBOX_RELAY_OWNER", "", "unique name of this relay in the lease table (default host-pid-random)")
	f.stringEnv(&s.txPrefix, "transactional-id-prefix", "TXBOX_TRANSACTIONAL_ID_PREFIX", "txbox", "prefix of each shard's Kafka transactional.id; unique per outbox on a cluster")
	f.stringEnv(&s.metricsAddr, "metrics-addr", "TXBOX_METRICS_ADDR", "127.0.0.1:9464", "address serving /metrics; empty disables it")
	f.stringEnv(&s.lagGroups, "lag-groups", "TXBOX_LAG_GROUPS", "", "comma-separated consumer groups whose lag is exported as txbox_consumer_lag_messages")
	f.varEnv(&s.shards, "shards", "TXBOX_SHARDS", "number of shard leases; must divide 256 and be the same on every relay")
	f.varEnv(&s.batchSize, "batch-size", "TXBOX_BATCH_SIZE", "rows published per batch (one Kafka transaction)")
	f.varEnv(&s.leaseTTL, "lease-ttl", "TXBOX_LEASE_TTL", "lease lifetime; a dead relay's shards move within about this long")
	f.varEnv(&s.pollInterval, "poll-interval", "TXBOX_POLL_INTERVAL", "idle wait between looks for new rows (publish latency at low load)")
	f.varEnv(&s.transactional, "transactional", "TXBOX_TRANSACTIONAL", "publish each batch as a Kafka transaction, fencing relays that lost their lease; false = idempotent producer only")
	// The Stripe key has no flag on purpose: flags show in ps and shell history.
	f.stringEnv(&s.stripeURL, "stripe-base-url", "TXBOX_STRIPE_BASE_URL", relay.DefaultStripeURL, "Stripe API address for side-effect calls, which run when "+relay.APIKeyEnvVar+" is set")
	f.varEnv(&s.replayWindow, "call-replay-window", "TXBOX_CALL_REPLAY_WINDOW", "oldest first attempt a call may have when sent; older calls go to the DLQ for reconciliation (below 24h)")
	f.varEnv(&s.callTimeout, "call-timeout", "TXBOX_CALL_TIMEOUT", "timeout of one side-effect request (default two thirds of --lease-ttl)")
	if err := f.parse(args); err != nil {
		return err
	}
	if f.NArg() > 0 {
		return fmt.Errorf("%w: relay takes no arguments, got %q", errUsage, f.Args())
	}
	if err := f.required("database-url", s.dsn); err != nil {
		return err
	}
	if err := f.required("kafka-brokers", s.brokers); err != nil {
		return err
	}

	sink, err := relay.NewKafkaSink(relay.KafkaConfig{
		Brokers:               strings.Split(s.brokers, ","),
		Transactional:         (*bool)(&s.transactional),
		TransactionalIDPrefix: s.txPrefix,
	})
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	pool, err := pgxpool.New(ctx, s.dsn)
	if err != nil {
		return fmt.Errorf("%w: --database-url: %w", errUsage, err)
	}
	defer pool.Close()

	var calls *relay.CallConfig
	if os.Getenv(relay.APIKeyEnvVar) != "" {
		calls = &relay.CallConfig{BaseURL: s.stripeURL, ReplayWindow: time.Duration(s.replayWindow), Timeout: time.Duration(s.callTimeout)}
	} else {
		slog.Info("side-effect calls are not executed: " + relay.APIKeyEnvVar + " is not set")
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	r, err := relay.New(relay.Config{
		DB: pool, Sink: sink, Schema: s.schema, Owner: s.owner,
		Shards: int(s.shards), BatchSize: int(s.batchSize),
		LeaseTTL: time.Duration(s.leaseTTL), PollInterval: time.Duration(s.pollInterval),
		Calls: calls, Registerer: reg,
	})
	if err != nil {
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if s.metricsAddr != "" {
		stop, err := serveMetrics(s.metricsAddr, reg)
		if err != nil {
			return err
		}
		defer stop()
	}
	if s.lagGroups != "" {
		mon, err := relay.NewLagMonitor(relay.LagConfig{
			Brokers: strings.Split(s.brokers, ","), Groups: strings.Split(s.lagGroups, ","), Registerer: reg,
		})
		if err != nil {
			return fmt.Errorf("%w: --lag-groups: %w", errUsage, err)
		}
		go func() { _ = mon.Run(ctx) }()
	}
	return r.Run(ctx)
}

// serveMetrics serves /metrics on addr until stop is called.
func serveMetrics(addr string, reg *prometheus.Registry) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			slog.Error("metrics server stopped", "error", err)
		}
	}()
	slog.Info("serving metrics", "addr", "http://"+ln.Addr().String()+"/metrics")
	return func() { _ = srv.Close() }, nil
}

type intValue int

func (v *intValue) String() string { return strconv.Itoa(int(*v)) }
func (v *intValue) Set(s string) error {
	n, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("not a whole number")
	}
	*v = intValue(n)
	return nil
}

type durationValue time.Duration

func (v *durationValue) String() string { return time.Duration(*v).String() }
func (v *durationValue) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return errors.New("not a duration such as 500ms or 10s")
	}
	*v = durationValue(d)
	return nil
}

type boolValue bool

func (v *boolValue) String() string   { return strconv.FormatBool(bool(*v)) }
func (v *boolValue) IsBoolFlag() bool { return true }
func (v *boolValue) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return errors.New("not true or false")
	}
	*v = boolValue(b)
	return nil
}

var _ flag.Value = (*boolValue)(nil)
