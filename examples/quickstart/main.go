// Quickstart runs the whole txbox path in one process and tells what happened:
//
//	producer transaction (order row + outbox row) → relay → Kafka → inbox-protected Watermill handler
//
// It needs only PostgreSQL: TXBOX_DATABASE_URL when set, else the local server on 127.0.0.1:5432,
// else a throwaway server started from the machine's PostgreSQL binaries. Kafka is TXBOX_KAFKA_BROKERS
// when set (the broker must allow topic auto-creation, Kafka's default), else an in-process
// Kafka-protocol broker. Everything lives in the schema txbox_quickstart, recreated on each run.
//
//	go run ./examples/quickstart
//
// Standard output is the story; library logs (warnings and errors only) go to standard error.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the database/sql driver goose migrates through
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/pgserver"
	"github.com/txbox/txbox/migrations"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

const (
	schema   = "txbox_quickstart"
	consumer = "balances" // the inbox deduplicates per consumer
	account  = "alice"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart failed:", err)
		os.Exit(1)
	}
}

// OrderPlaced is the event the producer writes to the outbox and the consumer applies.
type OrderPlaced struct {
	OrderID int    `json:"order_id"`
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
}

// run is the whole program, with the story written to out.
func run(ctx context.Context, out io.Writer) (err error) {
	say := newSayer(out)
	logs := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// --- Infrastructure: PostgreSQL, Kafka, a fresh schema -------------------------------------

	pg, err := pgserver.Discover(ctx, "TXBOX_DATABASE_URL", nil)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, pg.Stop()) }()
	brokers, stopKafka, err := kafkaBrokers()
	if err != nil {
		return err
	}
	defer stopKafka()
	say("PostgreSQL: %s; Kafka: %s", describePG(pg), describeKafka(brokers))

	pool, err := setUpSchema(ctx, pg.URL)
	if err != nil {
		return err
	}
	defer pool.Close()
	say("schema %s: recreated, txbox migrations applied, orders and balances tables created", schema)

	// A topic of its own per run, so a rerun against a real broker never reads the last run's events.
	topic := "txbox-quickstart.orders." + watermill.NewShortUUID()

	// --- Producer: business row and event in one transaction -----------------------------------

	writer, err := outbox.New(outbox.Config{Schema: schema})
	if err != nil {
		return err
	}
	order1, err := placeOrder(ctx, pool, writer, topic, OrderPlaced{OrderID: 1, Account: account, Amount: 100}, true)
	if err != nil {
		return err
	}
	say("order 1: wrote the order row and its OrderPlaced event (uuid %s) in one transaction; committed", order1.UUID)
	if _, err := placeOrder(ctx, pool, writer, topic, OrderPlaced{OrderID: 2, Account: account, Amount: 999}, false); err != nil {
		return err
	}
	say("order 2: wrote the order row and its OrderPlaced event in one transaction; rolled back")
	if _, err := placeOrder(ctx, pool, writer, topic, OrderPlaced{OrderID: 3, Account: account, Amount: 250}, true); err != nil {
		return err
	}
	say("order 3: wrote the order row and its OrderPlaced event in one transaction; committed")
	pending, err := count(ctx, pool, "txbox_outbox")
	if err != nil {
		return err
	}
	say("outbox: %d pending messages (order 2's event went away with its transaction)", pending)

	// --- Relay: outbox → Kafka ------------------------------------------------------------------

	stopRelay, err := startRelay(ctx, pool, brokers, logs)
	if err != nil {
		return err
	}
	defer stopRelay()
	if err := waitFor(ctx, "the relay to drain the outbox", func() (bool, error) {
		n, err := count(ctx, pool, "txbox_outbox")
		return n == 0, err
	}); err != nil {
		return err
	}
	say("relay: published %d messages to Kafka in transactions and deleted their outbox rows", pending)

	// --- Consumer: Kafka → inbox → handler ------------------------------------------------------

	c := &consumerState{say: say, applied: map[int]int{}}
	stopConsumer, err := startConsumer(ctx, pool, brokers, topic, c, logs)
	if err != nil {
		return err
	}
	defer stopConsumer()
	if err := waitFor(ctx, "the handler to apply orders 1 and 3", func() (bool, error) {
		return c.appliedCount(1) > 0 && c.appliedCount(3) > 0, nil
	}); err != nil {
		return err
	}

	// --- A duplicate delivery -------------------------------------------------------------------

	// A relay that dies after Kafka committed a batch but before deleting its rows publishes the
	// batch again when it restarts; sending order 1's event once more by hand has the same effect.
	if err := publishDirectly(brokers, topic, order1); err != nil {
		return err
	}
	say("duplicate: sent order 1's event (uuid %s) to Kafka a second time, as a relay restarted after a crash would", order1.UUID)
	if err := waitFor(ctx, "the duplicate to be delivered", func() (bool, error) {
		return c.skippedCount(order1.UUID) > 0, nil
	}); err != nil {
		return err
	}

	// --- What the database says -----------------------------------------------------------------

	// Every event has the key "alice", so all of them share one Kafka partition, in commit order. The
	// duplicate came after order 3's event: had order 2's event reached Kafka, it would have been
	// delivered before both.
	if n := c.appliedCount(2); n != 0 {
		return fmt.Errorf("order 2 was rolled back, yet its event was applied %d time(s)", n)
	}
	var order2Rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE id = 2`).Scan(&order2Rows); err != nil {
		return err
	}
	if order2Rows != 0 {
		return fmt.Errorf("order 2 was rolled back, yet its row exists")
	}
	say("order 2: rolled back, so neither its row nor its event exists; it never reached Kafka")

	var balance int64
	if err := pool.QueryRow(ctx, `SELECT balance FROM balances WHERE account = $1`, account).Scan(&balance); err != nil {
		return fmt.Errorf("read the balance: %w", err)
	}
	processed, err := count(ctx, pool, "txbox_inbox")
	if err != nil {
		return err
	}
	pending, err = count(ctx, pool, "txbox_outbox")
	if err != nil {
		return err
	}
	if balance != 350 || c.appliedCount(1) != 1 || c.appliedCount(3) != 1 || processed != 2 || pending != 0 {
		return fmt.Errorf("unexpected final state: balance %d (want 350), order 1 applied %d time(s), order 3 applied %d time(s), inbox rows %d (want 2), outbox rows %d (want 0)",
			balance, c.appliedCount(1), c.appliedCount(3), processed, pending)
	}
	say("final state: %s's balance is %d (100 + 250); each order applied once; inbox holds %d processed messages; duplicates skipped: %d; outbox empty",
		account, balance, processed, c.skippedTotal())
	if !pg.Throwaway {
		say("the schema stays until the next run, for a look with psql: TABLE %s.balances; TABLE %s.txbox_inbox;", schema, schema)
	}
	return nil
}

// --- Producer ----------------------------------------------------------------------------------

// placeOrder inserts the order and writes its event through the outbox in one transaction, then
// commits or rolls back: the event exists exactly when the order does.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, w *outbox.Writer, topic string, o OrderPlaced, commit bool) (*message.Message, error) {
	payload, err := json.Marshal(o)
	if err != nil {
		return nil, err
	}
	msg := message.NewMessage(watermill.NewUUID(), payload)
	// The key orders an account's events on the topic and becomes the Kafka record key.
	outbox.SetPartitionKey(msg, o.Account)

	tx, err := pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // A no-op after Commit.
	if _, err := tx.Exec(ctx, `INSERT INTO orders (id, account, amount) VALUES ($1, $2, $3)`, o.OrderID, o.Account, o.Amount); err != nil {
		return nil, fmt.Errorf("insert order %d: %w", o.OrderID, err)
	}
	if err := w.Publish(ctx, tx, topic, msg); err != nil {
		return nil, fmt.Errorf("write the event of order %d: %w", o.OrderID, err)
	}
	if !commit {
		return msg, tx.Rollback(ctx)
	}
	return msg, tx.Commit(ctx)
}

// --- Relay -------------------------------------------------------------------------------------

// startRelay runs a relay in the background, as `txbox relay` would in a process of its own.
func startRelay(ctx context.Context, pool *pgxpool.Pool, brokers []string, logs *slog.Logger) (stop func(), err error) {
	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers, TransactionalIDPrefix: "txbox-quickstart"})
	if err != nil {
		return nil, err
	}
	// Four shards rather than the default 16: each holds a Kafka producer and a database connection,
	// and three events need few.
	r, err := relay.New(relay.Config{DB: pool, Sink: sink, Schema: schema, Shards: 4, Logger: logs})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			logs.Error("relay", "error", err)
		}
	}, nil
}

// --- Consumer ----------------------------------------------------------------------------------

// consumerState is what the consumer saw, for the story and for the checks at the end.
type consumerState struct {
	say     func(format string, args ...any)
	mu      sync.Mutex
	applied map[int]int // order id → times the handler's transaction committed
	skipped []string    // UUIDs of deliveries the inbox recognised as duplicates
}

func (c *consumerState) appliedCount(order int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.applied[order]
}

func (c *consumerState) skippedCount(uuid string) (n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, u := range c.skipped {
		if u == uuid {
			n++
		}
	}
	return n
}

func (c *consumerState) skippedTotal() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.skipped)
}

// handled is how the handler tells the reporting middleware, which runs outside the inbox, that it
// ran and what it did; the inbox gives the handler a context derived from the message's, so a
// pointer placed there before the inbox is visible to the handler.
type handled struct {
	called  bool
	event   OrderPlaced
	balance int64
}

type handledKey struct{}

// report wraps the inbox. It tells the story once the inbox's transaction has ended: a delivery that
// reached the handler and committed was applied; one that was acknowledged without reaching the
// handler was a duplicate.
func (c *consumerState) report(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		var got handled
		msg.SetContext(context.WithValue(msg.Context(), handledKey{}, &got))
		produced, err := h(msg)
		if err != nil {
			return produced, err
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		if got.called {
			c.applied[got.event.OrderID]++
			c.say("handler: applied order %d (%s's balance += %d, now %d)", got.event.OrderID, got.event.Account, got.event.Amount, got.balance)
		} else {
			c.skipped = append(c.skipped, msg.UUID)
			c.say("inbox: duplicate delivery of %s recognised and skipped; the handler did not run", msg.UUID)
		}
		return produced, nil
	}
}

// apply is the business handler: it writes through the inbox's transaction, so the balance change
// and the inbox row commit together or not at all.
func apply(msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return errors.New("no inbox transaction: is the inbox middleware installed?")
	}
	var e OrderPlaced
	if err := json.Unmarshal(msg.Payload, &e); err != nil {
		return fmt.Errorf("%w: %w", inbox.ErrUnprocessable, err)
	}
	var balance int64
	err := tx.QueryRow(ctx, `
		INSERT INTO balances (account, balance) VALUES ($1, $2)
		ON CONFLICT (account) DO UPDATE SET balance = balances.balance + excluded.balance
		RETURNING balance`, e.Account, e.Amount).Scan(&balance)
	if err != nil {
		return err
	}
	if got, ok := ctx.Value(handledKey{}).(*handled); ok {
		*got = handled{called: true, event: e, balance: balance}
	}
	return nil
}

// startConsumer runs a Watermill router whose handler sits behind the inbox middleware.
func startConsumer(ctx context.Context, pool *pgxpool.Pool, brokers []string, topic string, c *consumerState, logs *slog.Logger) (stop func(), err error) {
	logger := watermill.NewSlogLogger(logs)
	ib, err := inbox.New(inbox.Config{DB: pool, Consumer: consumer, Schema: schema}, logger)
	if err != nil {
		return nil, err
	}
	sub, err := kafka.NewSubscriber(subscriberConfig(brokers), logger)
	if err != nil {
		return nil, err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return nil, err
	}
	// The inbox goes innermost, so that everything outside it sees the transaction's outcome.
	router.AddMiddleware(c.report, ib.Middleware)
	router.AddConsumerHandler("apply-orders", topic, sub, apply)

	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-done:
		cancel()
		return nil, fmt.Errorf("router: %w", err)
	}
	return func() {
		cancel()
		if err := <-done; err != nil {
			logs.Error("router", "error", err)
		}
	}, nil
}

// subscriberConfig reads with read_committed, so aborted Kafka transactions (a fenced relay's)
// are never seen, from the oldest offset, so events published before the consumer joined are read.
func subscriberConfig(brokers []string) kafka.SubscriberConfig {
	c := kafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_8_0_0
	c.Consumer.IsolationLevel = sarama.ReadCommitted
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	// Short timers make the example start and stop in seconds; the defaults suit production.
	c.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	c.Consumer.Group.Session.Timeout = 2 * time.Second
	c.Consumer.Group.Heartbeat.Interval = 200 * time.Millisecond
	c.Consumer.Group.Rebalance.Timeout = 3 * time.Second
	c.Metadata.Retry.Backoff = 100 * time.Millisecond
	return kafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: c,
		ConsumerGroup:         consumer,
	}
}

// publishDirectly sends msg with a plain watermill-kafka publisher, bypassing the outbox, with the
// same record key the relay uses so it lands on the same partition.
func publishDirectly(brokers []string, topic string, msg *message.Message) error {
	c := kafka.DefaultSaramaSyncPublisherConfig()
	c.Version = sarama.V2_8_0_0
	c.Metadata.Retry.Backoff = 100 * time.Millisecond
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers: brokers,
		Marshaler: kafka.NewWithPartitioningMarshaler(func(_ string, m *message.Message) (string, error) {
			return m.Metadata.Get(outbox.PartitionKeyMetadata), nil
		}),
		OverwriteSaramaConfig: c,
	}, nil)
	if err != nil {
		return err
	}
	defer pub.Close()
	return pub.Publish(topic, msg.Copy())
}

// --- Infrastructure ----------------------------------------------------------------------------

// kafkaBrokers returns TXBOX_KAFKA_BROKERS or starts an in-process Kafka-protocol broker.
func kafkaBrokers() (brokers []string, stop func(), err error) {
	if env := os.Getenv("TXBOX_KAFKA_BROKERS"); env != "" {
		return strings.Split(env, ","), func() {}, nil
	}
	cluster, err := kfake.NewCluster(
		kfake.NumBrokers(1),
		kfake.AllowAutoTopicCreation(),
		kfake.DefaultNumPartitions(3),
		// The example's consumer uses a 2s session timeout; kfake's default floor is 6s.
		kfake.GroupMinSessionTimeout(100*time.Millisecond),
	)
	if err != nil {
		return nil, nil, fmt.Errorf("start the in-process Kafka broker: %w", err)
	}
	return cluster.ListenAddrs(), cluster.Close, nil
}

func describePG(pg *pgserver.Server) string {
	switch {
	case os.Getenv("TXBOX_DATABASE_URL") != "":
		return "TXBOX_DATABASE_URL"
	case pg.Throwaway:
		return "a throwaway server (deleted on exit)"
	default:
		return "the local server on 127.0.0.1:5432"
	}
}

func describeKafka(brokers []string) string {
	if os.Getenv("TXBOX_KAFKA_BROKERS") != "" {
		return "TXBOX_KAFKA_BROKERS (" + strings.Join(brokers, ",") + ")"
	}
	return "an in-process broker on " + strings.Join(brokers, ",")
}

// setUpSchema recreates the example's schema, migrates it and creates the business tables. The
// returned pool's search_path is the schema, so the business SQL needs no qualification; txbox
// qualifies its own table names with Config.Schema.
func setUpSchema(ctx context.Context, url string) (*pgxpool.Pool, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	_, err = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
	conn.Close(context.WithoutCancel(ctx))
	if err != nil {
		return nil, fmt.Errorf("drop schema %s: %w", schema, err)
	}

	db, err := sql.Open("pgx", url)
	if err != nil {
		return nil, err
	}
	_, err = migrations.Up(ctx, db, migrations.WithSchema(schema))
	db.Close()
	if err != nil {
		return nil, err
	}

	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	_, err = pool.Exec(ctx, `
		CREATE TABLE orders   (id integer PRIMARY KEY, account text NOT NULL, amount bigint NOT NULL);
		CREATE TABLE balances (account text PRIMARY KEY, balance bigint NOT NULL)`)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("create business tables: %w", err)
	}
	return pool, nil
}

func count(ctx context.Context, pool *pgxpool.Pool, table string) (n int, err error) {
	err = pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, table}.Sanitize()).Scan(&n)
	return n, err
}

// waitFor polls cond until it holds; the example's steps are asynchronous, and a deadline turns a
// stuck step into an error that names it.
func waitFor(ctx context.Context, what string, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		ok, err := cond()
		if err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-t.C:
		}
	}
}

// newSayer writes story lines; it is safe for concurrent use because the handler's
// middleware tells part of the story.
func newSayer(out io.Writer) func(format string, args ...any) {
	var mu sync.Mutex
	return func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(out, format+"\n", args...)
	}
}
