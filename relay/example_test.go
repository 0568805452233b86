package relay_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txbox/txbox/internal/exampletest"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// An order service writes each order and the event announcing it in one transaction, and embeds a
// relay that publishes the events to Kafka.
func Example() {
	env, err := exampletest.Setup(`CREATE TABLE orders (id text PRIMARY KEY, account text NOT NULL, total bigint NOT NULL)`)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	ctx, stop := context.WithTimeout(context.Background(), time.Minute)
	defer stop()
	pool, brokers := env.Pool, env.Brokers

	w, err := outbox.New(outbox.Config{Schema: "txbox"})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := placeOrder(ctx, pool, w, "order-1", "alice", 4200); err != nil {
		fmt.Println(err)
		return
	}

	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- runRelay(relayCtx, pool, brokers) }()
	defer func() {
		stopRelay()
		if err := <-relayDone; err != nil {
			fmt.Println(err)
		}
	}()

	// What a read_committed consumer sees.
	sub, err := kafka.NewSubscriber(kafkasub.SubscriberConfig(brokers, ""), watermill.NopLogger{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	events, err := sub.Subscribe(ctx, "orders.placed")
	if err != nil {
		fmt.Println(err)
		return
	}
	select {
	case msg := <-events:
		fmt.Printf("orders.placed: %s, partition key %s\n", msg.Payload, msg.Metadata.Get(outbox.PartitionKeyMetadata))
		msg.Ack()
	case <-ctx.Done():
		fmt.Println(ctx.Err())
	}
	// Output:
	// orders.placed: {"order":"order-1","account":"alice","total":4200}, partition key order-1
}

// placeOrder stores an order and the event announcing it in one transaction: both commit, or
// neither does. The event carries what its consumers act on: billing debits the order's total
// from its account (the inbox's example).
func placeOrder(ctx context.Context, pool *pgxpool.Pool, w *outbox.Writer, id, account string, total int64) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit

	if _, err := tx.Exec(ctx, `INSERT INTO orders (id, account, total) VALUES ($1, $2, $3)`, id, account, total); err != nil {
		return err
	}
	msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order":%q,"account":%q,"total":%d}`, id, account, total))
	outbox.SetPartitionKey(msg, id) // same key → same order, same Kafka partition
	if err := w.Publish(ctx, tx, "orders.placed", msg); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// runRelay publishes the outbox to Kafka until ctx is cancelled, then stops gracefully: the batch
// in flight finishes and the leases are released, so other relays take over at once.
func runRelay(ctx context.Context, pool *pgxpool.Pool, brokers []string) error {
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers})
	if err != nil {
		return err
	}
	r, err := relay.New(relay.Config{DB: pool, Sink: sink, Schema: "txbox"})
	if err != nil {
		return err
	}
	return r.Run(ctx)
}
