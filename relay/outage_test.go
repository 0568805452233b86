package relay_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/relay"
)

// While Kafka refuses every connection the relay backs off, logs the outage once rather than on
// every retry or for every shard (each of the four fails), and publishes everything once Kafka is
// back. The outage needs a broker of the
// test's own that it can break, so this test always uses an in-process cluster.
func TestRelayRidesOutAKafkaOutage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cluster, err := kafkatest.Start()
	require.NoError(t, err)
	t.Cleanup(cluster.Close)
	brokers := cluster.ListenAddrs()

	var down atomic.Bool
	var refused atomic.Int64
	cluster.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if down.Load() {
			refused.Add(1)
			return nil, errors.New("broker down for the test"), true // closes the connection
		}
		return nil, nil, false
	})

	var logs proctest.Buffer
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers, TransactionalIDPrefix: b.env.Schema})
	require.NoError(t, err)
	r, err := relay.New(relay.Config{
		DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Shards: 4,
		LeaseTTL: 2 * time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})

	// Kafka goes away once the relay runs (a relay starting without it waits, holding no shard).
	require.Eventually(t, func() bool { return len(r.Shards()) == 4 }, 30*time.Second, 10*time.Millisecond)
	down.Store(true)
	uuids := b.write(t, true, "k", 20)
	// Several retries are refused while Kafka is down; nothing is lost meanwhile.
	require.Eventually(t, func() bool { return refused.Load() >= 20 }, 60*time.Second, 10*time.Millisecond)
	require.Equal(t, 20, b.pending(t))
	down.Store(false)

	sub, err := kafka.NewSubscriber(kafkatest.SubscriberConfig(brokers, "outage-"+watermill.NewShortUUID()), watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	subCtx, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	ch, err := sub.Subscribe(subCtx, b.topic)
	require.NoError(t, err)
	seen := map[string]bool{}
	timeout := time.After(60 * time.Second)
	for len(seen) < len(uuids) {
		select {
		case m := <-ch:
			seen[m.UUID] = true
			m.Ack()
		case <-timeout:
			t.Fatalf("only %d of %d messages arrived after the outage", len(seen), len(uuids))
		}
	}
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "publishing recovered") }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, strings.Count(logs.String(), "publishing recovered"), "once, when the last shard recovers:\n%s", logs.String())
	require.Equal(t, 1, strings.Count(logs.String(), "publishing failed"),
		"the outage is logged once, not on every retry:\n%s", logs.String())
}

// A relay started with a broker address that answers nothing (a typo in a rollout) takes no shard
// and does not count itself among the relays sharing them: the healthy relay keeps publishing
// every shard. Once the address answers, it starts and takes its share.
func TestARelayThatCannotReachTheBrokerLeavesTheShardsToOthers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	healthy := b.startRelay(t, func(c *relay.Config) { c.Owner = "healthy" })
	require.Eventually(t, func() bool { return len(healthy.Shards()) == 4 }, 30*time.Second, 10*time.Millisecond)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // Nothing answers there, for now.
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: []string{addr}, TransactionalIDPrefix: b.env.Schema})
	require.NoError(t, err)
	cut, err := relay.New(relay.Config{
		DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Owner: "cut-off",
		Shards: 4, LeaseTTL: 2 * time.Second, PollInterval: 10 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	require.NoError(t, err)
	runUntilCleanup(t, context.Background(), cut)
	require.Eventually(t, func() bool {
		err := cut.Ready()
		return err != nil && strings.Contains(err.Error(), "waiting for the broker to answer")
	}, 30*time.Second, 10*time.Millisecond, "%v", cut.Ready())

	b.write(t, true, "k", 20)
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)
	// Three lease rounds of the healthy relay (one every TTL/3): it never gives a shard up.
	require.Never(t, func() bool { return len(healthy.Shards()) < 4 }, 2*time.Second, 10*time.Millisecond)
	require.Empty(t, cut.Shards())

	// The address answers: bootstrap connections reach the cluster through it.
	ln, err = net.Listen("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go forward(ln, kafkatest.Brokers(t)[0])
	require.Eventually(t, func() bool { return len(cut.Shards()) == 2 && cut.Ready() == nil }, 30*time.Second, 10*time.Millisecond,
		"shards %v, ready: %v", cut.Shards(), cut.Ready())
}

// forward relays every connection ln accepts to target, until ln is closed.
func forward(ln net.Listener, target string) {
	for {
		in, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer in.Close()
			out, err := net.Dial("tcp", target)
			if err != nil {
				return
			}
			defer out.Close()
			go func() { _, _ = io.Copy(out, in) }()
			_, _ = io.Copy(in, out)
		}()
	}
}

// A relay that waited for its broker checks the lease layout once the broker answers, not before:
// a relay of another shard count that started meanwhile makes it refuse to start, where it used to
// register beside it and leave half the shards to no one.
func TestARelayThatWaitedForItsBrokerChecksTheLayoutWhenItStarts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: []string{addr}, TransactionalIDPrefix: b.env.Schema})
	require.NoError(t, err)
	waiting, err := relay.New(relay.Config{
		DB: b.env.Pool, Sink: sink, Schema: b.env.Schema, Owner: "waiting", Shards: 8, LeaseTTL: 2 * time.Second,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	require.NoError(t, err)
	done := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { done <- waiting.Run(ctx) }()
	require.Eventually(t, func() bool {
		err := waiting.Ready()
		return err != nil && strings.Contains(err.Error(), "waiting for the broker")
	}, 30*time.Second, 10*time.Millisecond)

	running := b.startRelay(t, func(c *relay.Config) { c.Owner = "running" }) // 4 shards
	require.Eventually(t, func() bool { return len(running.Shards()) == 4 }, 30*time.Second, 10*time.Millisecond)
	ln, err = net.Listen("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go forward(ln, kafkatest.Brokers(t)[0])
	select {
	case err := <-done:
		require.ErrorContains(t, err, "Config.Shards is 8 but running relays hold leases of a 4-shard layout")
	case <-time.After(30 * time.Second):
		t.Fatal("the relay started beside a relay of another layout")
	}
	require.Never(t, func() bool { return len(running.Shards()) < 4 }, time.Second, 10*time.Millisecond)
}

// Two relays of different shard counts starting at the same moment: one refuses, whichever checked
// second, because each registers in the transaction that checks, under the layout lock.
func TestRelaysOfTwoLayoutsStartingAtOnceDoNotBothRun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	results := make(chan error, 2)
	for _, shards := range []int{4, 8} {
		r, err := relay.New(relay.Config{
			DB: b.env.Pool, Sink: b.kafkaSink(t, kafkatest.Brokers(t), true), Schema: b.env.Schema,
			Owner: fmt.Sprint("layout-", shards), Shards: shards, LeaseTTL: 2 * time.Second,
			Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		go func() { results <- r.Run(ctx) }()
	}
	select {
	case err := <-results:
		require.ErrorContains(t, err, "running relays hold leases of a")
	case <-time.After(30 * time.Second):
		t.Fatal("relays of two layouts both run")
	}
}
