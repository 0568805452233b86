package inbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/exampletest"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
)

// A billing service debits accounts for placed orders. Kafka delivers order-1's event twice; the
// account is debited once.
func Example() {
	env, err := exampletest.Setup(`CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
		INSERT INTO accounts VALUES ('alice', 10000)`)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	ctx, stop := context.WithTimeout(context.Background(), time.Minute)
	defer stop()
	pool, brokers := env.Pool, env.Brokers

	// order-1 twice, as after a relay crash between Kafka's commit and the row's completion, then
	// order-2: once order-2 is applied, both copies of order-1 were handled before it.
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pub.Close()
	order1 := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"order-1","account":"alice","total":4200}`))
	order2 := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"order-2","account":"alice","total":1000}`))
	if err := pub.Publish("orders.placed", order1, order1.Copy(), order2); err != nil {
		fmt.Println(err)
		return
	}

	billingCtx, stopBilling := context.WithCancel(ctx)
	billingDone := make(chan error, 1)
	go func() { billingDone <- runBilling(billingCtx, pool, brokers, watermill.NopLogger{}) }()
	defer func() {
		stopBilling()
		if err := <-billingDone; err != nil {
			fmt.Println(err)
		}
	}()

	var balance int64
	for balance = 10000; balance == 10000 || balance == 10000-4200; {
		select {
		case <-ctx.Done():
			fmt.Println(ctx.Err())
			return
		case <-time.After(20 * time.Millisecond):
		}
		if err := pool.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = 'alice'`).Scan(&balance); err != nil {
			fmt.Println(err)
			return
		}
	}
	fmt.Println("alice's balance:", balance)
	// Output:
	// alice's balance: 4800
}

// runBilling consumes orders.placed until ctx is cancelled. Its writes commit in the inbox's
// transaction, together with the record that the message was processed.
func runBilling(ctx context.Context, pool *pgxpool.Pool, brokers []string, logger watermill.LoggerAdapter) error {
	ib, err := inbox.New(inbox.Config{DB: pool, Consumer: "billing", Schema: "txbox", Delivery: kafkasub.Delivery}, logger)
	if err != nil {
		return err
	}
	// read_committed; one subscriber, in a consumer group of its own, per handler (below)
	sub, err := kafkasub.NewSubscriber(kafkasub.SubscriberConfig(brokers, "billing.debit"), logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(middleware.Retry{MaxRetries: 3}.Middleware, ib.Middleware) // inbox innermost

	router.AddConsumerHandler("debit", "orders.placed", sub, func(msg *message.Message) error {
		var order struct {
			Account string
			Total   int64
		}
		if err := json.Unmarshal(msg.Payload, &order); err != nil {
			return fmt.Errorf("%w: %v", inbox.ErrUnprocessable, err) // to the DLQ at once
		}
		tx, _ := inbox.TxFromContext(msg.Context()) // your writes commit with the inbox row
		tag, err := tx.Exec(msg.Context(), `UPDATE accounts SET balance = balance - $1 WHERE id = $2`, order.Total, order.Account)
		if err == nil && tag.RowsAffected() == 0 {
			return fmt.Errorf("%w: no account %q", inbox.ErrUnprocessable, order.Account) // an unknown account is a dead letter, not a silent no-op
		}
		return err
	})
	return router.Run(ctx)
}

// A handler that must charge a card enqueues the Stripe call in the inbox's transaction; the relay
// sends it once the transaction commits. The call's Idempotency-Key derives from the consumer, the
// message and the call's name, so a redelivery that runs the handler again writes the same key.
func Example_call() {
	env, err := exampletest.Setup("")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer env.Close()
	w, err := outbox.New(outbox.Config{Schema: "txbox"})
	if err != nil {
		fmt.Println(err)
		return
	}
	ib, err := inbox.New(inbox.Config{DB: env.Pool, Consumer: "payments", Schema: "txbox"}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	var handlerRuns int
	handler := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		handlerRuns++
		tx, _ := inbox.TxFromContext(msg.Context())
		token := string(msg.Payload)
		key, err := w.Call(msg.Context(), tx, outbox.Call{
			Name:       "charge",      // tells the calls of one handler apart
			Path:       "/v1/charges", // Method defaults to POST
			Params:     url.Values{"amount": {"4200"}, "currency": {"eur"}, "source": {token}},
			ReplyTopic: "payments.charged", // optional: the result comes back as a message
		})
		fmt.Println("enqueued the charge with Idempotency-Key", key)
		return nil, err
	})

	// Without a broker: the middleware is a function, and a test can deliver a message twice.
	payment := message.NewMessage("payment-7", []byte("tok_visa"))
	for range 2 {
		if _, err := handler(payment); err != nil {
			fmt.Println(err)
			return
		}
	}
	var calls int
	if err := env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM txbox.txbox_outbox WHERE kind = 'call'`).Scan(&calls); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("handler runs: %d, calls pending: %d\n", handlerRuns, calls)
	// Output:
	// enqueued the charge with Idempotency-Key txbox_k4YnfwhwEEBpSseonB_EGm3nwESmRM3uds1PrUNF3ZM
	// handler runs: 1, calls pending: 1
}
