package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stripe/stripe-go/v82"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/migrations"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/stripetest"
)

// Consumers, as the inbox knows them; the charge's idempotency key derives from the first.
const (
	paymentsConsumer = "payments"
	resultsConsumer  = "payment-results"
)

// Faults injected, in terms of the payment number i (1-based).
const (
	duplicateEvery     = 4  // request i is delivered twice when i%4 == 0
	consumerCrashEvery = 7  // the handler fails after enqueueing, before commit, on the first delivery
	declineEvery       = 10 // the card is declined
	lostResponseEvery  = 5  // every 5th call request's response is lost on the way back...
	maxLostResponses   = 4  // ...up to this many
	relayCrashAtCall   = 3  // relay-a crashes after Stripe answered its 3rd call
)

type options struct {
	DatabaseURL string
	Schema      string
	Fresh       bool // drop and recreate Schema first
	Brokers     []string
	// StripeAPIKey selects Stripe itself, at StripeURL (default api.stripe.com); empty selects the
	// test double.
	StripeAPIKey, StripeURL string
	Payments                int
	ExternalRelays          bool
	Timeout                 time.Duration
	Verbose                 bool
	Log                     *slog.Logger
	Out                     io.Writer
}

// report is the reconciliation: what was asked, what was injected, what happened.
type report struct {
	Stripe                    string
	Payments                  int
	Deliveries                int
	DuplicatesSuppressed      int
	ReplyDuplicatesSuppressed int
	ConsumerCrashes           int
	LostResponses             int
	RelayCrash                string
	StripeRequests            int // -1 when unknown (Stripe itself)
	ChargesCreated            int
	Declined                  int
	DoubleCharges             int
	RepliesAppliedTwice       int
	Pending                   int
	Unaccounted               int // payments with neither a pending, done nor declined row
	DeadLetters               int
	Elapsed                   time.Duration
	requestUUIDs              []string
}

func (r report) ok() bool {
	return r.DoubleCharges == 0 && r.Pending == 0 && r.Unaccounted == 0 && r.RepliesAppliedTwice == 0
}

type paymentRequest struct {
	PaymentID string `json:"payment_id"`
	Amount    int64  `json:"amount"`
	Currency  string `json:"currency"`
	Source    string `json:"source"`
}

// app is the payment processor: its tables, its two handlers, and the faults it injects into them.
type app struct {
	o       options
	pool    *pgxpool.Pool
	writer  *outbox.Writer
	results string // the reply topic

	crashed         sync.Map // payment ids whose first delivery was made to fail
	consumerCrashes atomic.Int32
}

func (a *app) q(table string) string { return pgx.Identifier{a.o.Schema, table}.Sanitize() }

var errSimulatedCrash = errors.New("simulated crash after enqueueing, before commit")

// charge records the payment and enqueues its Stripe charge in the inbox's transaction.
func (a *app) charge(msg *message.Message) error {
	ctx := msg.Context()
	var p paymentRequest
	if err := json.Unmarshal(msg.Payload, &p); err != nil || p.PaymentID == "" {
		return fmt.Errorf("%w: bad payment request: %v", inbox.ErrUnprocessable, err)
	}
	tx, _ := inbox.TxFromContext(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO `+a.q("charges")+` (payment_id, request_uuid, amount, currency) VALUES ($1, $2, $3, $4)`,
		p.PaymentID, msg.UUID, p.Amount, p.Currency); err != nil {
		return err
	}
	_, err := a.writer.Call(ctx, tx, outbox.Call{
		Name: "charge", Path: "/v1/charges",
		Params: url.Values{
			"amount": {fmt.Sprint(p.Amount)}, "currency": {p.Currency}, "source": {p.Source},
			"description": {"txbox payments example"}, "metadata[payment_id]": {p.PaymentID},
		},
		ReplyTopic: a.results, PartitionKey: p.PaymentID,
		Metadata: map[string]string{"payment_id": p.PaymentID},
	})
	if err != nil {
		return err
	}
	if msg.Metadata.Get("crash") == "true" {
		if _, again := a.crashed.LoadOrStore(p.PaymentID, true); !again {
			a.consumerCrashes.Add(1)
			return errSimulatedCrash // rolls the transaction back, call included, as a crash would
		}
	}
	return nil
}

// applyResult applies Stripe's answer to the payment's row.
func (a *app) applyResult(msg *message.Message) error {
	ctx := msg.Context()
	res, err := outbox.ParseCallResult(msg)
	if err != nil {
		return fmt.Errorf("%w: %v", inbox.ErrUnprocessable, err)
	}
	status, failure := "done", ""
	switch res.Outcome {
	case outbox.OutcomeSucceeded:
	case outbox.OutcomeDeclined:
		status = "declined"
	case outbox.OutcomeDeadLettered:
		status = "needs_review" // The call is in the DLQ: reconcile it with Stripe.
	default:
		status = "failed"
	}
	if res.Error != nil {
		failure = res.Error.Message
	}
	tx, _ := inbox.TxFromContext(ctx)
	_, err = tx.Exec(ctx, `UPDATE `+a.q("charges")+` SET status = $2, charge_id = $3, failure = $4,
		replies_applied = replies_applied + 1, updated_at = now() WHERE payment_id = $1`,
		res.Metadata["payment_id"], status, res.ObjectID, failure)
	return err
}

func run(ctx context.Context, o options) (rep report, err error) {
	start := time.Now()
	runID := strings.ToLower(watermill.NewShortUUID()[:8])
	wlog := watermill.NewSlogLogger(o.Log)

	// PostgreSQL: txbox's tables and the application's charges table, in one schema.
	pool, err := setUpDatabase(ctx, o.DatabaseURL, o.Schema, o.Fresh)
	if err != nil {
		return rep, err
	}
	defer pool.Close()
	writer, err := outbox.New(outbox.Config{Schema: o.Schema})
	if err != nil {
		return rep, err
	}
	a := &app{o: o, pool: pool, writer: writer, results: "payments.charge-results." + runID}

	// Kafka.
	brokers := o.Brokers
	if len(brokers) == 0 {
		cluster, err := kfake.NewCluster(kfake.AllowAutoTopicCreation())
		if err != nil {
			return rep, fmt.Errorf("start the in-process Kafka broker: %w", err)
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
	}
	requests := "payments.requested." + runID

	// Stripe.
	apiKey, stripeURL := o.StripeAPIKey, o.StripeURL
	var double *stripetest.Server
	if apiKey == "" {
		double = stripetest.New(stripetest.Options{})
		defer double.Close()
		apiKey, stripeURL = stripetest.TestKey, double.URL()
		rep.Stripe = "txbox's Stripe test double"
		// Stripe having a bad minute: a rate limit and transient errors for whichever calls come first.
		double.Inject(stripetest.Fault{Kind: stripetest.Fault429, RetryAfter: time.Second})
		double.Inject(stripetest.Fault{Kind: stripetest.Fault500, Count: 2})
		if o.ExternalRelays {
			// The relays' transports are out of reach: lose responses at the double instead.
			double.Inject(stripetest.Fault{Kind: stripetest.FaultDropAfterCharge, Count: maxLostResponses})
		}
	} else {
		if stripeURL == "" {
			stripeURL = relay.DefaultStripeURL
		}
		rep.Stripe = "Stripe at " + stripeURL
	}
	fmt.Fprintf(o.Out, "payments example: %d payments, Kafka %s, Stripe: %s, schema %s\n",
		o.Payments, strings.Join(brokers, ","), rep.Stripe, o.Schema)

	// Consumers: the payment handler and the result handler, each behind its own inbox.
	reg := prometheus.NewRegistry()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, wlog)
	if err != nil {
		return rep, err
	}
	var deliveries, replyDeliveries atomic.Int32
	for _, h := range []struct {
		consumer, topic string
		count           *atomic.Int32
		handle          message.NoPublishHandlerFunc
	}{
		{paymentsConsumer, requests, &deliveries, a.charge},
		{resultsConsumer, a.results, &replyDeliveries, a.applyResult},
	} {
		ib, err := inbox.New(inbox.Config{DB: pool, Consumer: h.consumer, Schema: o.Schema, Registerer: reg, Delivery: kafkasub.Delivery}, wlog)
		if err != nil {
			return rep, err
		}
		sub, err := kafkasub.NewSubscriber(kafkasub.SubscriberConfig(brokers, h.consumer+"-"+runID), wlog)
		if err != nil {
			return rep, err
		}
		handler := router.AddConsumerHandler(h.consumer, h.topic, sub, h.handle)
		count := h.count
		handler.AddMiddleware(
			func(next message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					count.Add(1)
					return next(msg)
				}
			},
			// The inbox innermost: every retry is a new transaction.
			middleware.Retry{MaxRetries: 5, InitialInterval: 20 * time.Millisecond, Logger: wlog}.Middleware,
			ib.Middleware,
		)
	}
	routerCtx, stopRouter := context.WithCancel(context.WithoutCancel(ctx))
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(routerCtx) }()
	defer func() {
		stopRouter()
		if rerr := <-routerDone; rerr != nil && err == nil {
			err = rerr
		}
	}()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return rep, ctx.Err()
	}

	// Relays.
	var lost atomic.Int32
	var relayCrash atomic.Value
	relayCrash.Store("not reached")
	if o.ExternalRelays {
		printRelayCommands(o, brokers, stripeURL, runID, double != nil)
		relayCrash.Store("yours to cause: kill -9 a relay")
	} else {
		stopRelays, err := startRelays(ctx, o, pool, brokers, apiKey, stripeURL, runID, double == nil, &lost, &relayCrash)
		if err != nil {
			return rep, err
		}
		defer stopRelays()
	}

	// The upstream service: payment requests, some delivered twice.
	uuids, deliveriesSent, err := publishRequests(o, brokers, requests)
	if err != nil {
		return rep, err
	}
	rep.requestUUIDs = uuids

	// Wait for every payment to be settled, or for the timeout.
	deadline := time.Now().Add(o.Timeout)
	for {
		var rows, pending, outboxRows int
		err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+a.q("charges")+`),
			(SELECT count(*) FROM `+a.q("charges")+` WHERE status = 'pending'),
			(SELECT count(*) FROM `+a.q("txbox_outbox")+`)`).Scan(&rows, &pending, &outboxRows)
		if err != nil {
			return rep, err
		}
		if rows == o.Payments && pending == 0 && outboxRows == 0 {
			break
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(o.Out, "timeout: %d of %d payments recorded, %d pending, %d outbox rows left\n", rows, o.Payments, pending, outboxRows)
			break
		}
		select {
		case <-ctx.Done():
			return rep, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}

	rep.Payments = o.Payments
	rep.Deliveries = deliveriesSent
	rep.ConsumerCrashes = int(a.consumerCrashes.Load())
	rep.LostResponses = int(lost.Load())
	if o.ExternalRelays {
		rep.LostResponses = -1 // lost at the double, out of this program's sight
	}
	rep.RelayCrash = relayCrash.Load().(string)
	rep.Elapsed = time.Since(start)
	if err := a.reconcile(ctx, &rep, reg, double, apiKey, stripeURL, start); err != nil {
		return rep, err
	}
	printReport(o.Out, rep)
	return rep, nil
}

// setUpDatabase connects to PostgreSQL and installs txbox's tables in schema (dropping it first
// when fresh), then the application's charges table.
func setUpDatabase(ctx context.Context, dsn, schema string, fresh bool) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("TXBOX_DATABASE_URL: %w", err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("cannot reach PostgreSQL at %s:%d: %w\n"+
			"Start PostgreSQL there, or set TXBOX_DATABASE_URL to a database where you may create a schema.",
			cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
	}
	quoted := pgx.Identifier{schema}.Sanitize()
	if fresh {
		_, err = pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+quoted+` CASCADE`)
	}
	if err == nil {
		_, err = pool.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+quoted)
	}
	if err == nil {
		db := stdlib.OpenDBFromPool(pool)
		_, err = migrations.Up(ctx, db, migrations.WithSchema(schema))
		db.Close()
	}
	if err == nil {
		_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+quoted+`.charges (
			payment_id      text PRIMARY KEY,
			request_uuid    text NOT NULL,
			amount          bigint NOT NULL,
			currency        text NOT NULL,
			status          text NOT NULL DEFAULT 'pending',
			charge_id       text,
			failure         text,
			replies_applied integer NOT NULL DEFAULT 0,
			created_at      timestamptz NOT NULL DEFAULT now(),
			updated_at      timestamptz)`)
	}
	if err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// publishRequests sends the payment requests the way an upstream service would, delivering some
// twice (its retry after a lost ack). It returns the request UUIDs in payment order.
func publishRequests(o options, brokers []string, topic string) (uuids []string, sent int, err error) {
	cfg := kafka.DefaultSaramaSyncPublisherConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.Metadata.Retry.Backoff = 100 * time.Millisecond
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}, OverwriteSaramaConfig: cfg}, watermill.NewSlogLogger(o.Log))
	if err != nil {
		return nil, 0, err
	}
	defer pub.Close()
	runID := topic[strings.LastIndexByte(topic, '.')+1:]
	for i := 1; i <= o.Payments; i++ {
		p := paymentRequest{PaymentID: fmt.Sprintf("pay-%s-%03d", runID, i), Amount: int64(1000 + i), Currency: "eur", Source: "tok_visa"}
		if i%declineEvery == 0 {
			p.Source = "tok_chargeDeclined"
		}
		payload, _ := json.Marshal(p)
		msg := message.NewMessage(watermill.NewUUID(), payload)
		msg.Metadata.Set("payment_id", p.PaymentID)
		if i%consumerCrashEvery == 0 {
			msg.Metadata.Set("crash", "true")
		}
		copies := 1
		if i%duplicateEvery == 0 {
			copies = 2
		}
		for range copies {
			if err := pub.Publish(topic, msg); err != nil {
				return nil, sent, fmt.Errorf("publish payment request: %w", err)
			}
			sent++
		}
		uuids = append(uuids, msg.UUID)
	}
	return uuids, sent, nil
}

// startRelays runs two relays in this process. relay-a "crashes" right after Stripe answered its
// relayCrashAtCall-th call: from then on it reaches neither the database nor Stripe, as if its
// process had died, and relay-b takes its shards over once its leases expire. Both lose some of
// Stripe's responses on the way back.
func startRelays(ctx context.Context, o options, pool *pgxpool.Pool, brokers []string, apiKey, stripeURL, runID string,
	realStripe bool, lost *atomic.Int32, crash *atomic.Value,
) (stop func(), err error) {
	var requests atomic.Int32
	loseOne := func() bool {
		for {
			n := lost.Load()
			if n >= maxLostResponses {
				return false
			}
			if lost.CompareAndSwap(n, n+1) {
				return true
			}
		}
	}
	lossy := func(base http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			res, err := base.RoundTrip(req)
			if err != nil || req.Header.Get("Idempotency-Key") == "" {
				return res, err
			}
			if requests.Add(1)%lostResponseEvery == 0 && loseOne() {
				// Stripe executed the request; its answer never arrives.
				_, _ = io.Copy(io.Discard, res.Body)
				res.Body.Close()
				return nil, errors.New("simulated: connection reset before the response arrived")
			}
			return res, nil
		})
	}
	timeout := time.Duration(0) // two thirds of the lease TTL: plenty for the double
	if realStripe {
		timeout = 20 * time.Second
	}
	newRelay := func(name string, db relay.DB, transport http.RoundTripper) (*relay.Relay, error) {
		sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: brokers, TransactionalIDPrefix: o.Schema + "-" + runID})
		if err != nil {
			return nil, err
		}
		return relay.New(relay.Config{
			DB: db, Sink: sink, Schema: o.Schema, Owner: name + "-" + runID,
			Shards: 4, LeaseTTL: 3 * time.Second, PollInterval: 10 * time.Millisecond,
			Calls: &relay.CallConfig{
				APIKey: apiKey, BaseURL: stripeURL, HTTPClient: &http.Client{Transport: transport}, Timeout: timeout,
				MinBackoff: 100 * time.Millisecond, MaxBackoff: time.Second, PollInterval: 20 * time.Millisecond,
			},
			Logger: o.Log,
		})
	}

	// relay-a's crash is injected where a library user can reach: its HTTP client (the response
	// to its relayCrashAtCall-th call is lost and it dies) and its database handle (from then on
	// every statement fails, so it records nothing and renews no lease).
	crashable := &crashableDB{pool: pool}
	var calls atomic.Int32
	lossyA := lossy(http.DefaultTransport.(*http.Transport).Clone())
	dying := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		if crashable.crashed.Load() {
			return nil, errRelayCrashed
		}
		res, err := lossyA.RoundTrip(req)
		if err != nil || req.Header.Get("Idempotency-Key") == "" || calls.Add(1) != relayCrashAtCall {
			return res, err
		}
		crashable.crashed.Store(true)
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		crash.Store(fmt.Sprintf("relay-a, right after Stripe answered its call #%d", relayCrashAtCall))
		o.Log.Warn("relay-a crashed (simulated) before recording its call's result; relay-b takes over when its leases expire")
		return nil, errRelayCrashed
	})
	a, err := newRelay("relay-a", crashable, dying)
	if err != nil {
		return nil, err
	}
	b, err := newRelay("relay-b", pool, lossy(http.DefaultTransport.(*http.Transport).Clone()))
	if err != nil {
		return nil, err
	}

	ctxA, stopA := context.WithCancel(context.WithoutCancel(ctx))
	ctxB, stopB := context.WithCancel(context.WithoutCancel(ctx))
	doneA, doneB := make(chan error, 1), make(chan error, 1)
	go func() { doneA <- a.Run(ctxA) }()
	// relay-b joins once relay-a holds every shard, so relay-a surely has calls to crash in; it
	// hands half of them over at its next lease tick.
	for deadline := time.Now().Add(30 * time.Second); len(a.Shards()) < 4 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	go func() { doneB <- b.Run(ctxB) }()
	return func() {
		stopA()
		stopB()
		<-doneA
		<-doneB
	}, nil
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

var errRelayCrashed = errors.New("relay-a has crashed (simulated): it reaches nothing any more")

// crashableDB is the database as seen by a relay process that can die: once crashed, every
// statement fails, so the relay can neither record anything nor renew its leases. It wraps the
// pool rather than embedding it, so that a method relay.DB gains cannot bypass the crash.
type crashableDB struct {
	pool    *pgxpool.Pool
	crashed atomic.Bool
}

// SendBatch is how the relay begins its transactions (pgx's Batch.BeginTx) and reads.
func (d *crashableDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if d.crashed.Load() {
		return pgx.FailedBatchResults(b, errRelayCrashed)
	}
	return d.pool.SendBatch(ctx, b)
}

func (d *crashableDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if d.crashed.Load() {
		return errRow{}
	}
	return d.pool.QueryRow(ctx, sql, args...)
}

type errRow struct{}

func (errRow) Scan(...any) error { return errRelayCrashed }

// printRelayCommands prints the shell lines that start relays for this run. No secret is in them:
// a command line is visible to every user of the machine (ps), so the database URL goes through the
// environment, and it is printed without its password.
func printRelayCommands(o options, brokers []string, stripeURL, runID string, double bool) {
	dsn, hadPassword := withoutPassword(o.DatabaseURL)
	fmt.Fprintf(o.Out, "\nStart two or more relays in other terminals, in this directory (kill -9 one of them while calls run).\n"+
		"In each terminal, first:\n\n")
	fmt.Fprintf(o.Out, "  export TXBOX_DATABASE_URL=%s\n", shellQuote(dsn))
	if hadPassword {
		fmt.Fprintf(o.Out, "  export PGPASSWORD=...   # the database password, left out of the URL above\n")
	}
	if double {
		fmt.Fprintf(o.Out, "  export STRIPE_API_KEY=%s   # the test double's key, not a secret\n", stripetest.TestKey)
	} else {
		fmt.Fprintf(o.Out, "  export STRIPE_API_KEY=...   # your Stripe test-mode key\n")
	}
	fmt.Fprintf(o.Out, "\nthen one of:\n\n")
	for _, name := range []string{"relay-1", "relay-2"} {
		fmt.Fprintf(o.Out, "  go run ./cmd/txbox relay --schema %s --kafka-brokers %s --transactional-id-prefix %s \\\n"+
			"      --stripe-base-url %s --shards 4 --lease-ttl 3s --owner %s --metrics-addr ''\n\n",
			shellQuote(o.Schema), shellQuote(strings.Join(brokers, ",")), shellQuote(o.Schema+"-"+runID), shellQuote(stripeURL), name)
	}
	fmt.Fprintf(o.Out, "Waiting up to %s for them to settle every payment...\n", o.Timeout)
}

// withoutPassword returns the connection string dsn, in URL or keyword/value form, with its
// password removed, and whether it had one.
func withoutPassword(dsn string) (string, bool) {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		_, had := u.User.Password()
		if had {
			u.User = url.User(u.User.Username())
		}
		if q := u.Query(); q.Has("password") {
			q.Del("password")
			u.RawQuery, had = q.Encode(), true
		}
		return u.String(), had
	}
	out := strings.TrimSpace(keywordPassword.ReplaceAllString(dsn, ""))
	return out, out != strings.TrimSpace(dsn)
}

// keywordPassword matches a password setting in a keyword/value connection string, quoted or not.
var keywordPassword = regexp.MustCompile(`(^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'|\S*)`)

// shellQuote quotes s for a POSIX shell when it holds anything but plain characters.
func shellQuote(s string) string {
	plain := func(r rune) bool {
		return r < utf8.RuneSelf && (unicode.IsLetter(r) || unicode.IsDigit(r) || strings.ContainsRune("@%+=:,./_-", r))
	}
	if s != "" && strings.IndexFunc(s, func(r rune) bool { return !plain(r) }) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// reconcile counts, from the application's rows, the inbox's metrics and Stripe's side, what
// happened to every payment.
func (a *app) reconcile(ctx context.Context, rep *report, reg *prometheus.Registry, double *stripetest.Server, apiKey, stripeURL string, start time.Time) error {
	err := a.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'pending'),
			count(*) FILTER (WHERE replies_applied > 1),
			$1 - count(*) FILTER (WHERE status IN ('pending', 'done', 'declined', 'failed', 'needs_review')),
			(SELECT count(*) FROM `+a.q("txbox_dlq")+`)
		FROM `+a.q("charges"), rep.Payments).Scan(&rep.Pending, &rep.RepliesAppliedTwice, &rep.Unaccounted, &rep.DeadLetters)
	if err != nil {
		return err
	}
	hits, err := dedupHits(reg)
	if err != nil {
		return err
	}
	rep.DuplicatesSuppressed, rep.ReplyDuplicatesSuppressed = hits[paymentsConsumer], hits[resultsConsumer]

	if double != nil {
		rep.StripeRequests = double.Requests()
		ours := 0
		for _, u := range rep.requestUUIDs {
			// The consumer's router handler has the consumer's name.
			k := outbox.IdempotencyKey(outbox.Source{Consumer: paymentsConsumer, Handler: paymentsConsumer, DedupKey: u}, "charge")
			charged, declined := double.ChargesFor(k), double.DeclinesFor(k)
			rep.ChargesCreated += charged
			rep.Declined += declined
			rep.DoubleCharges += max(charged+declined-1, 0)
			ours += charged
		}
		rep.DoubleCharges += double.TotalCharges() - ours // charges under keys no payment has
		return nil
	}

	// Stripe itself: count the charge objects of this run's payments by their metadata.
	rep.StripeRequests = -1
	rows, err := a.pool.Query(ctx, `SELECT payment_id FROM `+a.q("charges"))
	if err != nil {
		return err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	perPayment := map[string]int{}
	for _, id := range ids {
		perPayment[id] = 0
	}
	b := stripe.NewBackendsWithConfig(&stripe.BackendConfig{URL: stripe.String(stripeURL), LeveledLogger: &stripe.LeveledLogger{Level: stripe.LevelNull}})
	sc := stripe.NewClient(apiKey, stripe.WithBackends(b))
	params := &stripe.ChargeListParams{CreatedRange: &stripe.RangeQueryParams{GreaterThanOrEqual: start.Add(-time.Minute).Unix()}}
	params.Limit = stripe.Int64(100)
	for ch, err := range sc.V1Charges.List(ctx, params) {
		if err != nil {
			return fmt.Errorf("list Stripe charges: %w", err)
		}
		id := ch.Metadata["payment_id"]
		if _, ours := perPayment[id]; !ours {
			continue // another program's charge, or another run's
		}
		perPayment[id]++
		if ch.Status == stripe.ChargeStatusFailed {
			rep.Declined++
		} else {
			rep.ChargesCreated++
		}
	}
	for _, n := range perPayment {
		rep.DoubleCharges += max(n-1, 0)
	}
	return nil
}

func dedupHits(reg *prometheus.Registry) (map[string]int, error) {
	families, err := reg.Gather()
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, f := range families {
		if f.GetName() != "txbox_dedup_hits_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "consumer" {
					out[l.GetValue()] += int(m.GetCounter().GetValue())
				}
			}
		}
	}
	return out, nil
}

func printReport(w io.Writer, r report) {
	requests := "n/a (Stripe itself)"
	if r.StripeRequests >= 0 {
		requests = fmt.Sprint(r.StripeRequests)
	}
	must0 := func(n int) string {
		if n == 0 {
			return "0   ok"
		}
		return fmt.Sprintf("%d   MUST BE 0", n)
	}
	fmt.Fprintf(w, "\nReconciliation (%s, %s)\n\n", r.Stripe, r.Elapsed.Round(100*time.Millisecond))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "  payments requested\t%d\n", r.Payments)
	fmt.Fprintf(tw, "  request deliveries sent (with duplicates)\t%d\n", r.Deliveries)
	fmt.Fprintf(tw, "  duplicate requests suppressed by the inbox\t%d\n", r.DuplicatesSuppressed)
	fmt.Fprintf(tw, "  consumer crashes before commit (injected)\t%d\n", r.ConsumerCrashes)
	if r.LostResponses >= 0 {
		fmt.Fprintf(tw, "  Stripe responses lost (injected)\t%d\n", r.LostResponses)
	} else {
		fmt.Fprintf(tw, "  Stripe responses lost (injected)\tup to %d, at the test double\n", maxLostResponses)
	}
	fmt.Fprintf(tw, "  relay crash after a call (injected)\t%s\n", r.RelayCrash)
	fmt.Fprintf(tw, "  requests Stripe received\t%s\n", requests)
	fmt.Fprintf(tw, "  charges created\t%d\n", r.ChargesCreated)
	fmt.Fprintf(tw, "  cards declined (an outcome, not an error)\t%d\n", r.Declined)
	fmt.Fprintf(tw, "  duplicate replies suppressed by the inbox\t%d\n", r.ReplyDuplicatesSuppressed)
	fmt.Fprintf(tw, "  double charges\t%s\n", must0(r.DoubleCharges))
	fmt.Fprintf(tw, "  replies applied twice\t%s\n", must0(r.RepliesAppliedTwice))
	fmt.Fprintf(tw, "  still pending\t%s\n", must0(r.Pending+r.Unaccounted))
	fmt.Fprintf(tw, "  dead letters\t%d\n", r.DeadLetters)
	_ = tw.Flush()
	fmt.Fprintln(w)
}
