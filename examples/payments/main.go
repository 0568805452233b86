// Command payments is the payment processor from txbox's design, end to end, with the faults it
// is built to survive injected on purpose.
//
// Payment requests arrive on a Kafka topic. A Watermill handler behind the txbox inbox records each
// one as a pending row in `charges` and, in the same transaction, enqueues the Stripe charge with
// outbox.Call. Relays execute the call with an Idempotency-Key derived from the request, and the
// Stripe answer comes back as a reply message that a second inbox-protected handler applies to the
// row. Meanwhile the program delivers some requests twice, makes the handler fail after enqueueing
// (as a crash before commit would), loses some of Stripe's responses on the way back, and crashes
// one relay right after Stripe answered one of its calls. It ends with a reconciliation table and
// exits non-zero if any payment was charged twice or is still pending.
//
//	go run ./examples/payments
//
// Everything it needs is embedded unless told otherwise:
//
//   - PostgreSQL: TXBOX_DATABASE_URL, else the local server on 127.0.0.1:5432. The example
//     (re)creates the schema txbox_payments_example there.
//   - Kafka: TXBOX_KAFKA_BROKERS, else an in-process Kafka-protocol cluster (kfake).
//   - Stripe: with STRIPE_API_KEY set (a test-mode key, sk_test_…), Stripe's API at
//     TXBOX_STRIPE_BASE_URL or api.stripe.com; else txbox's Stripe test double (package
//     stripetest), which keeps Stripe's idempotency rules and takes injected faults.
//
// With -external-relays the program runs no relay of its own: it prints the `txbox relay` command
// lines to start in other terminals (kill -9 one of them mid-run to see a crash) and waits for them
// to finish the work. The lines hold no secret: the relays read the database URL (printed without
// its password) and the Stripe key from their environment.
package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	var o options
	flag.IntVar(&o.Payments, "payments", 40, "payment requests to send")
	flag.BoolVar(&o.ExternalRelays, "external-relays", false, "run no relay in-process; print `txbox relay` command lines and wait for those relays")
	flag.DurationVar(&o.Timeout, "timeout", 3*time.Minute, "give up waiting for the payments after this long")
	flag.BoolVar(&o.Verbose, "v", false, "log what the relays and consumers do")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	level := slog.LevelWarn
	if o.Verbose {
		level = slog.LevelInfo
	}
	o.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	o.Out = os.Stdout
	o.Brokers = splitList(os.Getenv("TXBOX_KAFKA_BROKERS"))
	o.StripeAPIKey = os.Getenv("STRIPE_API_KEY")
	o.StripeURL = os.Getenv("TXBOX_STRIPE_BASE_URL")
	o.Schema = "txbox_payments_example"
	o.Fresh = true
	o.DatabaseURL = cmp.Or(os.Getenv("TXBOX_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")

	rep, err := run(ctx, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
	if !rep.ok() {
		fmt.Fprintln(os.Stderr, "payments: reconciliation failed")
		os.Exit(1)
	}
}

func splitList(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, ",")
}
