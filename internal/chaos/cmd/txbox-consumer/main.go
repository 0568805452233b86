// Command txbox-consumer is the consumer process of the chaos tests: a Watermill router reading a
// topic with a read_committed Kafka subscriber, behind txbox's inbox middleware, whose handler is
// chaos.Apply (one effects row per application, and optionally a Stripe charge through the outbox).
//
// A message whose payload is "poison" kills the process with SIGKILL from inside the handler, every
// time: the poison pill that the inbox's durable attempt counting must move to the dead-letter table.
// TXBOX_FAILPOINTS arms the inbox's failpoints (inbox.after-insert, inbox.after-handler,
// inbox.before-commit, inbox.after-commit). SIGINT or SIGTERM stops it gracefully.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/chaos"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/outbox"
)

// Poison is the payload that kills the consumer process.
const Poison = "poison"

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "txbox-consumer:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		dsn         = flag.String("database-url", "", "PostgreSQL connection string (required)")
		schema      = flag.String("schema", "", "schema holding txbox's tables and the effects table (required)")
		brokers     = flag.String("kafka-brokers", "", "comma-separated Kafka brokers (required)")
		topic       = flag.String("topic", "", "topic to consume (required)")
		consumer    = flag.String("consumer", "", "consumer name that deduplication is scoped to (required)")
		group       = flag.String("group", "", "Kafka consumer group (default: the consumer name)")
		instance    = flag.String("instance-id", "", "static group membership id: a restarted process with the same id takes its predecessor's partitions at once")
		maxAttempts = flag.Int("max-attempts", 0, "deliveries before a message is dead-lettered (default: the inbox's)")
		charge      = flag.Bool("charge", false, "write a Stripe charge into the outbox for every message")
	)
	flag.Parse()
	for _, f := range []struct{ name, value string }{
		{"database-url", *dsn}, {"schema", *schema}, {"kafka-brokers", *brokers}, {"topic", *topic}, {"consumer", *consumer},
	} {
		if f.value == "" {
			return fmt.Errorf("--%s is required", f.name)
		}
	}
	if *group == "" {
		*group = *consumer
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	pool, err := pgxpool.New(ctx, *dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	ib, err := inbox.New(inbox.Config{DB: pool, Consumer: *consumer, Schema: *schema, MaxAttempts: *maxAttempts}, logger)
	if err != nil {
		return err
	}
	var charges *outbox.Writer
	if *charge {
		if charges, err = outbox.New(outbox.Config{Schema: *schema}); err != nil {
			return err
		}
	}
	subCfg := kafkatest.SubscriberConfig(strings.Split(*brokers, ","), *group)
	subCfg.OverwriteSaramaConfig.Consumer.Group.InstanceId = *instance
	sub, err := kafka.NewSubscriber(subCfg, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(ib.Middleware)
	apply := chaos.Apply(*schema, charges)
	router.AddConsumerHandler(chaos.HandlerName, *topic, sub, func(msg *message.Message) error {
		if string(msg.Payload) == Poison {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // SIGKILL is not delivered synchronously; never run past this point.
		}
		return apply(msg)
	})
	if err := router.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}
