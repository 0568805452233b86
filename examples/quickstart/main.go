// Quickstart is txbox's whole path in one program: a service writes an order and its event in one
// transaction; the relay publishes the event to Kafka; Kafka delivers it twice; the billing
// consumer, behind the inbox, invoices the order once.
//
// PostgreSQL: TXBOX_DATABASE_URL, else the local server on 127.0.0.1:5432; the schema
// txbox_quickstart is recreated on every run. Kafka: TXBOX_KAFKA_BROKERS, else an in-process
// Kafka-protocol cluster (kfake).
package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

func main() {
	dsn := cmp.Or(os.Getenv("TXBOX_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	brokers := strings.FieldsFunc(os.Getenv("TXBOX_KAFKA_BROKERS"), func(r rune) bool { return r == ',' })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout, dsn, brokers); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, out io.Writer, dsn string, brokers []string) error {
	logs := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	wlog := watermill.NewSlogLogger(logs)
	pool, err := setUp(ctx, dsn) // txbox's tables, and the service's orders and invoices
	if err != nil {
		return err
	}
	defer pool.Close()
	if len(brokers) == 0 {
		cluster, err := kfake.NewCluster(kfake.AllowAutoTopicCreation())
		if err != nil {
			return err
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
	}
	topic := "orders." + watermill.NewShortUUID() // a fresh topic per run

	// 1. The service writes the order and its event in one transaction: both commit, or neither.
	w, err := outbox.New(outbox.Config{Schema: schema})
	if err != nil {
		return err
	}
	event := message.NewMessage(watermill.NewUUID(), []byte("order-1"))
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total) VALUES ('order-1', 4200)`); err != nil {
			return err
		}
		return w.Publish(ctx, tx, topic, event)
	})
	if err != nil {
		return err
	}
	fmt.Fprintln(out, "service: order-1 and its event committed in one transaction")

	// 2. The relay publishes committed events to Kafka; in production, `txbox relay` does.
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers})
	if err != nil {
		return err
	}
	r, err := relay.New(relay.Config{DB: pool, Sink: sink, Schema: schema, Shards: 1, Logger: logs})
	if err != nil {
		return err
	}
	defer runInBackground(ctx, logs, r.Run)()

	// 3. The billing consumer's handler writes through the inbox's transaction, which also records
	// the event as processed: a second delivery finds that record and skips the handler.
	ib, err := inbox.New(inbox.Config{DB: pool, Consumer: "billing", Schema: schema, Delivery: kafkasub.Delivery}, wlog)
	if err != nil {
		return err
	}
	sub, err := kafkasub.NewSubscriber(kafkasub.SubscriberConfig(brokers, "billing.invoice"), wlog)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, wlog)
	if err != nil {
		return err
	}
	acked := make(chan string, 2) // deliveries acknowledged, seen from outside the inbox
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			produced, err := h(msg)
			if err == nil {
				acked <- msg.UUID
			}
			return produced, err
		}
	}, ib.Middleware)
	router.AddConsumerHandler("invoice", topic, sub, func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		fmt.Fprintf(out, "billing: invoicing %s\n", msg.Payload)
		_, err := tx.Exec(msg.Context(), `INSERT INTO invoices (order_id, amount) VALUES ($1, 4200)`, string(msg.Payload))
		return err
	})
	defer runInBackground(ctx, logs, router.Run)()
	if err := receive(ctx, acked); err != nil {
		return fmt.Errorf("waiting for the first delivery: %w", err)
	}
	fmt.Fprintln(out, "relay → Kafka → inbox: the event was delivered and processed")

	// 4. Kafka delivers at least once: a relay that crashed after Kafka committed, before deleting
	// the row, publishes the event again. Here the copy is sent by hand.
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}}, wlog)
	if err != nil {
		return err
	}
	defer pub.Close()
	if err := pub.Publish(topic, event.Copy()); err != nil {
		return err
	}
	if err := receive(ctx, acked); err != nil {
		return fmt.Errorf("waiting for the second delivery: %w", err)
	}
	var invoices int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&invoices); err != nil {
		return err
	}
	fmt.Fprintf(out, "kafka delivered the event again; the inbox skipped it: %d invoice for order-1\n", invoices)
	return nil
}
