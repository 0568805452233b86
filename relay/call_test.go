package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/metrics"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/stripetest"
)

// callBundle is one test's outbox, Stripe test double and in-memory sink for replies.
type callBundle struct {
	env    *txtest.Env
	writer *outbox.Writer
	stripe *stripetest.Server
	sink   *memSink
}

func setupCalls(t *testing.T) *callBundle {
	t.Helper()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	s := stripetest.New(stripetest.Options{})
	t.Cleanup(s.Close)
	return &callBundle{env: env, writer: w, stripe: s, sink: &memSink{}}
}

// callRelay is an in-process relay with calls enabled, stopped when the test ends or by stop.
type callRelay struct {
	*relay.Relay
	reg  *prometheus.Registry
	stop func() error // stops the relay and returns what Run returned; safe from any goroutine
}

// startCallRelay runs a relay that executes calls against the bundle's double with short backoffs.
// Keep-alives are off, so that every call meets the double on a connection of its own
// (TestALostResponseOnAReusedConnectionIsCountedAsAnAttempt runs with them on).
func (b *callBundle) startCallRelay(t *testing.T, mutate func(*relay.Config)) *callRelay {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg := relay.Config{
		DB: b.env.Pool, Sink: b.sink, Schema: b.env.Schema,
		Shards: 1, LeaseTTL: 2 * time.Second, PollInterval: 10 * time.Millisecond,
		Calls: &relay.CallConfig{
			APIKey: stripetest.TestKey, BaseURL: b.stripe.URL(),
			HTTPClient: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}},
			MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, PollInterval: 10 * time.Millisecond,
		},
		Logger:     slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Registerer: reg,
	}
	if mutate != nil {
		mutate(&cfg)
	}
	r, err := relay.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stop := sync.OnceValue(func() error {
		cancel()
		return <-done
	})
	t.Cleanup(func() { require.NoError(t, stop()) })
	return &callRelay{Relay: r, reg: reg, stop: stop}
}

func (b *callBundle) enqueue(t *testing.T, c outbox.Call) string {
	t.Helper()
	ctx := context.Background()
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	key, err := b.writer.Call(ctx, tx, c)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return key
}

func chargeCall(key string, amount int) outbox.Call {
	return outbox.Call{
		IdempotencyKey: key, Name: "charge", Path: "/v1/charges", ReplyTopic: "charge-results",
		Params:   url.Values{"amount": {fmt.Sprint(amount)}, "currency": {"eur"}, "source": {"tok_visa"}},
		Metadata: map[string]string{"payment_id": key},
	}
}

func (b *callBundle) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func (b *callBundle) pendingCalls(t *testing.T) int {
	return b.count(t, "SELECT count(*) FROM "+b.env.Q("txbox_outbox")+" WHERE kind = 'call'")
}

type callResultRow struct {
	outcome    string
	status     int
	objectID   string
	body       string
	attempts   int
	durationMs int64
}

func (b *callBundle) result(t *testing.T, key string) (callResultRow, bool) {
	t.Helper()
	var r callResultRow
	err := b.env.Pool.QueryRow(context.Background(), `SELECT outcome, http_status, object_id, body, attempts, duration_ms FROM `+
		b.env.Q("txbox_call_result")+` WHERE idempotency_key = $1`, key).
		Scan(&r.outcome, &r.status, &r.objectID, &r.body, &r.attempts, &r.durationMs)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false
	}
	require.NoError(t, err)
	return r, true
}

func (b *callBundle) waitResult(t *testing.T, key string) callResultRow {
	t.Helper()
	require.Eventually(t, func() bool { _, ok := b.result(t, key); return ok }, 30*time.Second, 10*time.Millisecond,
		"call %s completed", key)
	r, _ := b.result(t, key)
	return r
}

type deadCall struct {
	kind, reason, errText string
	attempts              int
	payload               []byte
}

func (b *callBundle) dead(t *testing.T, key string) (deadCall, bool) {
	t.Helper()
	var d deadCall
	err := b.env.Pool.QueryRow(context.Background(), `SELECT kind, reason, error, attempts, payload FROM `+
		b.env.Q("txbox_dlq")+` WHERE idempotency_key = $1`, key).Scan(&d.kind, &d.reason, &d.errText, &d.attempts, &d.payload)
	if errors.Is(err, pgx.ErrNoRows) {
		return d, false
	}
	require.NoError(t, err)
	return d, true
}

func (b *callBundle) waitDead(t *testing.T, key string) deadCall {
	t.Helper()
	require.Eventually(t, func() bool { _, ok := b.dead(t, key); return ok }, 30*time.Second, 10*time.Millisecond,
		"call %s dead-lettered", key)
	d, _ := b.dead(t, key)
	return d
}

// memSink is a Sink that keeps what the relay publishes.
type memSink struct {
	mu   sync.Mutex
	msgs []relay.Message
}

func (s *memSink) Open(context.Context, int, int64) (relay.ShardPublisher, error) { return s, nil }

func (s *memSink) Publish(_ context.Context, msgs []relay.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.msgs = append(s.msgs, msgs...)
	return nil
}

func (s *memSink) Close() error { return nil }

// replies returns the reply messages published for the call with key.
func (s *memSink) replies(key string) []relay.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []relay.Message
	for _, m := range s.msgs {
		if m.Msg.UUID == outbox.ReplyUUID(key) {
			out = append(out, m)
		}
	}
	return out
}

// repliesWith returns the replies published for the call with key that tell outcome.
func (s *memSink) repliesWith(key, outcome string) []*message.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*message.Message
	for _, m := range s.msgs {
		if res, err := outbox.ParseCallResult(m.Msg); err == nil && res.IdempotencyKey == key && res.Outcome == outcome {
			out = append(out, m.Msg)
		}
	}
	return out
}

// byUUID returns the message published with uuid, or nil.
func (s *memSink) byUUID(uuid string) *message.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.msgs {
		if m.Msg.UUID == uuid {
			return m.Msg
		}
	}
	return nil
}

func counterValue(t *testing.T, c prometheus.Collector) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 16)
	c.Collect(ch)
	close(ch)
	var sum float64
	for m := range ch {
		var pb dto.Metric
		require.NoError(t, m.Write(&pb))
		switch {
		case pb.Counter != nil:
			sum += pb.Counter.GetValue()
		case pb.Histogram != nil:
			sum += float64(pb.Histogram.GetSampleCount())
		}
	}
	return sum
}

// Stripe charges, then the connection drops before the response arrives. The relay cannot know
// whether it charged; it retries with the same key, Stripe replays the stored response, and the
// result recorded is that one charge.
func TestCallResponseLostAfterChargeIsReplayed(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	key := "pay-lost-response"
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.FaultDropAfterCharge, Key: key})
	b.enqueue(t, chargeCall(key, 1000))
	b.startCallRelay(t, nil)

	res := b.waitResult(t, key)
	require.Equal(t, 1, b.stripe.ChargesFor(key), "exactly one charge")
	require.Equal(t, 1, b.stripe.TotalCharges(), "exactly one charge, under any key")
	require.Equal(t, 2, b.stripe.RequestsFor(key), "the lost response was retried once")
	require.Equal(t, outbox.OutcomeSucceeded, res.outcome)
	require.Equal(t, 200, res.status)
	require.Equal(t, 2, res.attempts)
	require.Equal(t, b.stripe.ObjectIDsFor(key), []string{res.objectID}, "the result is the charge made by the first attempt")
	require.Contains(t, res.body, res.objectID)
	require.Zero(t, b.pendingCalls(t))

	require.Eventually(t, func() bool { return len(b.sink.replies(key)) == 1 }, 10*time.Second, 10*time.Millisecond)
	reply := b.sink.replies(key)[0]
	require.Equal(t, "charge-results", reply.Topic)
	require.Equal(t, key, reply.Key, "the reply keeps the call's partition key")
	require.Equal(t, key, reply.Msg.Metadata.Get("payment_id"), "the call's metadata travels with the reply")
	got, err := outbox.ParseCallResult(reply.Msg)
	require.NoError(t, err)
	require.Equal(t, res.objectID, got.ObjectID)
	require.Equal(t, "charge", got.Object)
	require.Equal(t, "succeeded", got.Status)
	require.Equal(t, 2, got.Attempts)
	require.Equal(t, outbox.CallUUID(key), got.CallUUID)
	require.JSONEq(t, res.body, string(got.Body))
}

// The same on a connection an earlier call left open: net/http would resend a request that
// carries an Idempotency-Key there by itself, an attempt the relay never counted, logged or
// spaced. Every request the provider sees is an attempt of the relay's.
func TestALostResponseOnAReusedConnectionIsCountedAsAnAttempt(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	b.startCallRelay(t, func(cfg *relay.Config) { cfg.Calls.HTTPClient = nil }) // keep-alives on, as by default
	b.enqueue(t, chargeCall("pay-first", 500))
	b.waitResult(t, "pay-first")

	key := "pay-lost-on-a-reused-connection"
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.FaultDropAfterCharge, Key: key})
	b.enqueue(t, chargeCall(key, 1000))
	res := b.waitResult(t, key)
	require.Equal(t, 1, b.stripe.ChargesFor(key), "exactly one charge")
	require.Equal(t, 2, b.stripe.RequestsFor(key))
	require.Equal(t, 2, res.attempts, "the provider saw two requests")
}

// A call whose reply the outbox refuses (its metadata, which the reply carries, is larger than the
// outbox takes) is charged once and completed, and its reply is the dead letter: the completion
// does not fail, and hold up its shard, until the replay window ends.
func TestAReplyTheOutboxRefusesIsALetter(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	big := chargeCall("pay-big-metadata", 1000)
	big.Metadata["blob"] = strings.Repeat("x", outbox.DefaultMaxPayloadBytes)
	b.enqueue(t, big)
	after := b.enqueue(t, chargeCall("pay-after", 500))
	b.startCallRelay(t, nil)

	res := b.waitResult(t, big.IdempotencyKey)
	require.Equal(t, outbox.OutcomeSucceeded, res.outcome)
	require.Equal(t, 1, b.stripe.ChargesFor(big.IdempotencyKey), "exactly one charge")
	b.waitResult(t, after)
	require.Eventually(t, func() bool { return b.pendingCalls(t) == 0 }, 10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return len(b.sink.replies(after)) == 1 }, 10*time.Second, 10*time.Millisecond,
		"the next call of the shard completed and replied")
	require.Empty(t, b.sink.replies(big.IdempotencyKey))

	var reason, errText, uuid, topic string
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT reason, error, uuid, topic FROM "+b.env.Q("txbox_dlq")).
		Scan(&reason, &errText, &uuid, &topic))
	require.Equal(t, relay.ReasonReplyUnwritable, reason)
	require.Contains(t, errText, "over the")
	require.Equal(t, outbox.ReplyUUID(big.IdempotencyKey), uuid)
	require.Equal(t, "charge-results", topic)
	require.Equal(t, 1, b.stripe.RequestsFor(big.IdempotencyKey), "completed at the first send: never sent again")
}

// A relay takes a shard over while the previous owner's request is still at Stripe: the new
// owner's attempt with the same key gets 409 and is retried, the old owner's late answer cannot
// complete anything (its lease is fenced), and the call charges once and replies once.
func TestCallTakenOverMidFlightChargesOnce(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	key := "pay-takeover"
	release := make(chan struct{})
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.FaultSlow, Key: key, Release: release})
	ttl := func(c *relay.Config) { c.LeaseTTL = 3 * time.Second }
	zombie := b.startCallRelay(t, ttl)
	b.enqueue(t, chargeCall(key, 1000))
	require.Eventually(t, func() bool { return b.stripe.InFlight(key) }, 30*time.Second, 5*time.Millisecond)
	require.Len(t, zombie.Shards(), 1)

	// The takeover: the lease gets a new token, as after an expiry. The zombie is stopped from
	// re-taking it (it finishes in-flight work on shutdown, which is exactly the zombie's call).
	_, err := b.env.Pool.Exec(context.Background(), fmt.Sprintf(
		`UPDATE %s SET token = nextval('%s.txbox_lease_token'), owner = NULL, expires_at = '-infinity'`,
		b.env.Q("txbox_lease"), b.env.Schema))
	require.NoError(t, err)
	stopped := make(chan error, 1)
	go func() { stopped <- zombie.stop() }()

	b.startCallRelay(t, ttl)
	require.Eventually(t, func() bool { return b.stripe.RequestsFor(key) >= 2 }, 30*time.Second, 5*time.Millisecond,
		"the new owner sent the call while the first request was in flight")
	require.Equal(t, 1, b.stripe.ChargesFor(key))
	_, done := b.result(t, key)
	require.False(t, done, "a 409 is not an outcome")

	close(release) // the zombie's request answers now, or was abandoned already
	res := b.waitResult(t, key)
	require.NoError(t, <-stopped)
	require.Equal(t, 1, b.stripe.ChargesFor(key), "one charge")
	require.Equal(t, 1, b.stripe.TotalCharges(), "one charge, under any key")
	require.Equal(t, b.stripe.ObjectIDsFor(key), []string{res.objectID})
	require.GreaterOrEqual(t, res.attempts, 2)
	require.Zero(t, b.pendingCalls(t))
	require.Eventually(t, func() bool { return len(b.sink.replies(key)) == 1 }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.env.Q("txbox_dlq")))
	require.Len(t, b.sink.replies(key), 1, "one reply")
}

// Stripe says the key was first used with other parameters. Retrying cannot succeed and a new key
// could charge twice: the call goes to the DLQ, is counted for alerting, and is never sent again.
func TestCallKeyReusedWithOtherParamsGoesToDLQ(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	key := "pay-mismatch"
	p := &stripe.ChargeCreateParams{Amount: stripe.Int64(500), Currency: stripe.String("eur"),
		Source: &stripe.PaymentSourceSourceParams{Token: stripe.String("tok_visa")}}
	p.SetIdempotencyKey(key)
	_, err := b.stripe.Client(nil).V1Charges.Create(context.Background(), p)
	require.NoError(t, err)

	b.enqueue(t, chargeCall(key, 1000))
	r := b.startCallRelay(t, nil)
	d := b.waitDead(t, key)
	require.Equal(t, relay.ReasonIdempotencyMismatch, d.reason)
	require.Equal(t, "call", d.kind)
	require.Equal(t, 1, d.attempts)
	require.Contains(t, d.errText, "idempotency_error")
	var req outbox.CallRequest
	require.NoError(t, json.Unmarshal(d.payload, &req), "the letter keeps the request for a person")
	require.Equal(t, "1000", req.Params.Get("amount"))
	require.Equal(t, 1.0, counterValue(t, metrics.NewCalls(r.reg, b.env.Schema).IdempotencyErrors))

	// A later call on the same shard completing proves the worker moved past the dead one.
	b.enqueue(t, chargeCall("pay-after-mismatch", 100))
	b.waitResult(t, "pay-after-mismatch")
	require.Equal(t, 2, b.stripe.RequestsFor(key), "one request of ours, never repeated")
	require.Equal(t, 1, b.stripe.ChargesFor(key), "only the original charge")
	_, done := b.result(t, key)
	require.False(t, done)
	require.Zero(t, b.pendingCalls(t))
	require.Empty(t, b.sink.replies(key), "no reply of a completed call: the call has no outcome")
	b.requireDeadLetteredReply(t, key, relay.ReasonIdempotencyMismatch)
}

// requireDeadLetteredReply requires that the call with key, moved to the dead-letter table for
// reason, told its reply topic so: whoever waits for its reply would wait for ever.
func (b *callBundle) requireDeadLetteredReply(t *testing.T, key, reason string) {
	t.Helper()
	b.requireDeadLetteredReplies(t, key, reason, 1)
}

// requireDeadLetteredReplies requires n such replies of calls with key, each under a UUID of its
// own: the consumer's inbox would take one for a copy of another.
func (b *callBundle) requireDeadLetteredReplies(t *testing.T, key, reason string, n int) {
	t.Helper()
	var replies []*message.Message
	require.Eventually(t, func() bool { replies = b.sink.repliesWith(key, outbox.OutcomeDeadLettered); return len(replies) >= n },
		10*time.Second, 10*time.Millisecond, "a reply says that the call was dead-lettered")
	require.Len(t, replies, n)
	uuids := map[string]bool{outbox.ReplyUUID(key): true} // A later call with the key replies under it.
	for _, reply := range replies {
		require.False(t, uuids[reply.UUID], "reply UUID %s taken", reply.UUID)
		uuids[reply.UUID] = true
		got, err := outbox.ParseCallResult(reply)
		require.NoError(t, err)
		require.Equal(t, outbox.OutcomeDeadLettered, got.Outcome)
		require.Equal(t, key, got.IdempotencyKey)
		require.Equal(t, "charge", got.Name)
		require.Equal(t, reason, got.Error.Code)
		require.NotEmpty(t, got.Error.Message)
		require.Equal(t, key, got.Metadata["payment_id"], "the call's metadata, as on every reply")
	}
}

// A call an operator buries (txbox outbox bury, the console's Bury) replies like one the relay
// dead-letters: the application waiting for its reply learns that the relay will not do it. The
// relay started after the burial publishes the reply and never sends the call.
func TestABuriedCallReplies(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	key := "pay-buried"
	admin, err := relay.NewAdmin(relay.AdminConfig{Schema: b.env.Schema})
	require.NoError(t, err)
	// Buried, written again with its key (reconciled, to be done after all), and buried again:
	// the second reply was under the first's UUID, and the consumer's inbox dropped it.
	for _, ticket := range []string{"OPS-7", "OPS-8"} {
		b.enqueue(t, chargeCall(key, 700))
		calls, err := admin.List(context.Background(), b.env.Pool, relay.Filter{Kind: "call"})
		require.NoError(t, err)
		require.Len(t, calls, 1)
		_, err = admin.Bury(context.Background(), b.env.Pool, calls[0].ID, "charged by hand, ticket "+ticket)
		require.NoError(t, err)
	}
	b.startCallRelay(t, nil)
	b.requireDeadLetteredReplies(t, key, relay.ReasonBuried, 2)
	reply, err := outbox.ParseCallResult(b.sink.repliesWith(key, outbox.OutcomeDeadLettered)[0])
	require.NoError(t, err)
	require.Contains(t, reply.Error.Message, "OPS-7", "the operator's reason")
	require.Eventually(t, func() bool {
		return b.pendingCalls(t) == 0 && b.count(t, "SELECT count(*) FROM "+b.env.Q("txbox_outbox")) == 0
	},
		10*time.Second, 10*time.Millisecond, "the reply went out")
	require.Zero(t, b.stripe.ChargesFor(key), "a buried call is never sent")
}

// A call an operator buries while its request is at the provider is done by the provider all the
// same: the relay keeps the answer when it comes, as the key's result, and replies with it after
// the burial's reply, and says so in its log. Before, the completion found the row gone and
// dropped the answer: the application was told only dead_lettered, and nothing stored the charge.
func TestACallBuriedWhileAtTheProviderKeepsItsAnswer(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	const key = "pay-buried-in-flight"
	release := make(chan struct{})
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.FaultSlow, Key: key, Release: release})
	var log proctest.Buffer
	b.startCallRelay(t, func(c *relay.Config) { c.Logger = slog.New(slog.NewTextHandler(&log, nil)) })
	b.enqueue(t, chargeCall(key, 4200))
	require.Eventually(t, func() bool { return b.stripe.InFlight(key) }, 30*time.Second, 5*time.Millisecond)

	admin, err := relay.NewAdmin(relay.AdminConfig{Schema: b.env.Schema})
	require.NoError(t, err)
	calls, err := admin.List(context.Background(), b.env.Pool, relay.Filter{Kind: "call"})
	require.NoError(t, err)
	require.Len(t, calls, 1)
	_, err = admin.Bury(context.Background(), b.env.Pool, calls[0].ID, "looks stuck")
	require.NoError(t, err)
	close(release)

	require.Equal(t, outbox.OutcomeSucceeded, b.waitResult(t, key).outcome, "the provider's answer is the key's result")
	require.Equal(t, 1, b.stripe.ChargesFor(key))
	b.requireDeadLetteredReply(t, key, relay.ReasonBuried)
	require.Eventually(t, func() bool { return len(b.sink.replies(key)) == 1 }, 10*time.Second, 10*time.Millisecond, "the answer is replied")
	require.Contains(t, log.String(), "a call buried while its request was at the provider was answered")
}

// Stripe may forget a key after 24 hours. A call whose first attempt is older than the replay
// window is never sent: it goes to the DLQ with a reason that asks a person to reconcile. One just
// inside the window is still sent.
func TestCallOlderThanReplayWindowIsNeverSent(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	old, young := "pay-too-old", "pay-still-young"
	b.enqueue(t, chargeCall(old, 1000))
	b.enqueue(t, chargeCall(young, 1000))
	// As if earlier attempts had failed long ago: ages by the database clock.
	_, err := b.env.Pool.Exec(context.Background(), `UPDATE `+b.env.Q("txbox_outbox")+` SET attempts = 3,
		first_attempt_at = now() - CASE idempotency_key WHEN $1 THEN interval '23 hours 1 minute' ELSE interval '22 hours 58 minutes' END`, old)
	require.NoError(t, err)
	b.startCallRelay(t, nil)

	d := b.waitDead(t, old)
	require.Equal(t, relay.ReasonCallTooOld, d.reason)
	require.Equal(t, 3, d.attempts, "the attempts that were sent")
	require.Contains(t, d.errText, old)
	require.Contains(t, d.errText, "Stripe dashboard")
	require.Contains(t, d.errText, "never redrive")
	require.Zero(t, b.stripe.RequestsFor(old), "zero requests sent")

	res := b.waitResult(t, young)
	require.Equal(t, 4, res.attempts)
	require.Equal(t, 1, b.stripe.ChargesFor(young))
	require.Zero(t, b.stripe.RequestsFor(old))
	require.Zero(t, b.pendingCalls(t))
	b.requireDeadLetteredReply(t, old, relay.ReasonCallTooOld)
}

// Rate limits and transient failures are retried with the same key, no sooner than Retry-After,
// until the call is done with one charge.
func TestCallRetriesRateLimitsAndServerErrors(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	key := "pay-flaky"
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.Fault500, Key: key, Count: 2})
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.Fault503, Key: key})
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.Fault429, Key: key, RetryAfter: time.Second})
	b.enqueue(t, chargeCall(key, 1000))
	start := time.Now()
	b.startCallRelay(t, nil)

	res := b.waitResult(t, key)
	// Backoffs are 10-50ms here, so only the 429's Retry-After: 1 makes it take a second.
	require.GreaterOrEqual(t, time.Since(start), time.Second, "Retry-After was honoured")
	require.Equal(t, 1, b.stripe.ChargesFor(key))
	require.Equal(t, 1, b.stripe.TotalCharges())
	require.Equal(t, 5, b.stripe.RequestsFor(key))
	require.Equal(t, 5, res.attempts)
	require.Equal(t, outbox.OutcomeSucceeded, res.outcome)
	require.Zero(t, b.stripe.PendingFaults())
}

// A declined card is an outcome of the call, not an infrastructure failure: it is done, with the
// decline as its result, and never retried.
func TestCallDeclinedCardIsAnOutcome(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	key := "pay-declined"
	c := chargeCall(key, 1000)
	c.Params.Set("source", "tok_chargeDeclinedInsufficientFunds")
	b.enqueue(t, c)
	b.startCallRelay(t, nil)

	res := b.waitResult(t, key)
	require.Equal(t, outbox.OutcomeDeclined, res.outcome)
	require.Equal(t, http.StatusPaymentRequired, res.status)
	require.Equal(t, 1, res.attempts)
	require.Equal(t, b.stripe.ObjectIDsFor(key), []string{res.objectID}, "the failed charge")
	require.Equal(t, 1, b.stripe.RequestsFor(key))
	require.Zero(t, b.stripe.ChargesFor(key))

	require.Eventually(t, func() bool { return len(b.sink.replies(key)) == 1 }, 10*time.Second, 10*time.Millisecond)
	got, err := outbox.ParseCallResult(b.sink.replies(key)[0].Msg)
	require.NoError(t, err)
	require.Equal(t, outbox.OutcomeDeclined, got.Outcome)
	require.Equal(t, "card_declined", got.Error.Code)
	require.Equal(t, "insufficient_funds", got.Error.DeclineCode)
	_, dead := b.dead(t, key)
	require.False(t, dead)
}

// Stripe stores a 500 that happened after the endpoint started executing and replays it for the
// key: retrying can never change it and whether money moved is unknown, so a person decides.
func TestCallStoredServerErrorGoesToDLQ(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	key := "pay-indeterminate"
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.Fault500Stored, Key: key})
	b.enqueue(t, chargeCall(key, 1000))
	b.startCallRelay(t, nil)

	d := b.waitDead(t, key)
	require.Equal(t, relay.ReasonCallIndeterminate, d.reason)
	require.Equal(t, 1, b.stripe.RequestsFor(key))
	require.Zero(t, b.pendingCalls(t))
	b.requireDeadLetteredReply(t, key, relay.ReasonCallIndeterminate)
}

// A call that takes longer than the lease TTL keeps the lease (it is renewed while the call is in
// flight), so the other relay never starts the same call concurrently; its duration is recorded.
func TestLongCallKeepsItsLease(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	key := "pay-slow"
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.FaultSlow, Key: key, Delay: 2500 * time.Millisecond})
	short := func(c *relay.Config) {
		c.LeaseTTL = time.Second
		c.Calls.Timeout = 5 * time.Second
	}
	r1 := b.startCallRelay(t, short)
	r2 := b.startCallRelay(t, short)
	b.enqueue(t, chargeCall(key, 1000))

	res := b.waitResult(t, key)
	require.Equal(t, 1, b.stripe.Requests(), "no second relay sent the call")
	require.Equal(t, 1, b.stripe.TotalCharges())
	require.GreaterOrEqual(t, res.durationMs, int64(2500))
	observed := counterValue(t, metrics.NewCalls(r1.reg, b.env.Schema).Duration) + counterValue(t, metrics.NewCalls(r2.reg, b.env.Schema).Duration)
	require.Equal(t, 1.0, observed, "one duration sample for one request")
}

// Calls with one partition key run in the order they were written: a later call waits while an
// earlier one is retried.
func TestCallsOfOneKeyKeepTheirOrder(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	first, second := chargeCall("order-9-charge", 1000), chargeCall("order-9-extra", 200)
	first.PartitionKey, second.PartitionKey = "order-9", "order-9"
	b.stripe.Inject(stripetest.Fault{Kind: stripetest.Fault429, Key: first.IdempotencyKey, RetryAfter: time.Second})
	b.enqueue(t, first)
	b.enqueue(t, second)
	b.startCallRelay(t, func(c *relay.Config) { c.Shards = 4 })

	b.waitResult(t, first.IdempotencyKey)
	b.waitResult(t, second.IdempotencyKey)
	var firstDone, secondDone time.Time
	q := `SELECT completed_at FROM ` + b.env.Q("txbox_call_result") + ` WHERE idempotency_key = $1`
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), q, first.IdempotencyKey).Scan(&firstDone))
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), q, second.IdempotencyKey).Scan(&secondDone))
	require.True(t, secondDone.After(firstDone), "the second call waited for the first (%s, %s)", firstDone, secondDone)
}

// Whatever answers at the base URL may quote the API key (a proxy or a double echoing the
// Authorization header; Stripe itself masks it): the key is masked in the log, in last_error, in
// the stored result and in the reply, so it is never logged or stored.
func TestAnAnswerQuotingTheAPIKeyIsNeitherLoggedNorStored(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	const apiKey = "sk_test_echoedBackByTheProxy0123456789"
	var reject atomic.Bool // 401 until the test has seen last_error, then 400
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		status, typ := http.StatusUnauthorized, "invalid_request_error"
		if reject.Load() {
			status = http.StatusBadRequest
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
			"type": typ, "message": "no such thing for " + r.Header.Get("Authorization"),
		}})
	}))
	t.Cleanup(echo.Close)

	key := "pay-echo"
	b.enqueue(t, chargeCall(key, 100))
	var log proctest.Buffer
	b.startCallRelay(t, func(c *relay.Config) {
		c.Calls.APIKey, c.Calls.BaseURL = apiKey, echo.URL
		c.Logger = slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})

	var lastError string
	require.Eventually(t, func() bool {
		err := b.env.Pool.QueryRow(context.Background(), `SELECT coalesce(last_error, '') FROM `+b.env.Q("txbox_outbox")+` WHERE kind = 'call'`).Scan(&lastError)
		return err == nil && lastError != ""
	}, 10*time.Second, 5*time.Millisecond, "the 401 is recorded")
	require.Contains(t, lastError, "HTTP 401")
	require.NotContains(t, lastError, apiKey)
	require.Contains(t, lastError, "no such thing for Bearer [STRIPE_API_KEY]")

	reject.Store(true)
	res := b.waitResult(t, key)
	require.Equal(t, outbox.OutcomeRejected, res.outcome)
	require.NotContains(t, res.body, apiKey)
	require.Eventually(t, func() bool { return len(b.sink.repliesWith(key, outbox.OutcomeRejected)) > 0 }, 10*time.Second, 10*time.Millisecond)
	reply := b.sink.repliesWith(key, outbox.OutcomeRejected)[0]
	require.NotContains(t, string(reply.Payload), apiKey)
	got, err := outbox.ParseCallResult(reply)
	require.NoError(t, err)
	require.Equal(t, "no such thing for Bearer [STRIPE_API_KEY]", got.Error.Message)
	require.Contains(t, log.String(), "HTTP 401", "the 401 was logged")
	require.NotContains(t, log.String(), apiKey)
}

func TestCallConfigValidation(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	for _, c := range []relay.CallConfig{
		{APIKey: stripetest.TestKey, ReplayWindow: 24 * time.Hour},
		{APIKey: stripetest.TestKey, ReplayWindow: -time.Hour},
		{APIKey: stripetest.TestKey, BaseURL: "api.stripe.com"},
		{APIKey: stripetest.TestKey, MinBackoff: time.Minute, MaxBackoff: time.Second},
		{APIKey: stripetest.TestKey, Timeout: -time.Second},
		{APIKey: "pk_test_publishable"},
		{APIKey: "sk_test_pasted\n"},
		{APIKey: "sk_test_a\r\nX-Evil: 1"},
		{APIKey: "not-a-key"},
	} {
		_, err := relay.New(relay.Config{DB: b.env.Pool, Sink: b.sink, Schema: b.env.Schema, Calls: &c})
		require.Error(t, err, "%+v", c)
		if c.APIKey != stripetest.TestKey {
			require.ErrorContains(t, err, relay.APIKeyEnvVar)
			require.NotContains(t, err.Error(), strings.TrimSpace(c.APIKey), "the key is never quoted")
		}
	}
	for _, u := range []string{"https://proxy:hunter2@stripe.internal", "https://proxy:hunter2@not a host"} {
		_, err := relay.New(relay.Config{DB: b.env.Pool, Sink: b.sink, Schema: b.env.Schema,
			Calls: &relay.CallConfig{APIKey: stripetest.TestKey, BaseURL: u}})
		require.ErrorContains(t, err, "CallConfig.BaseURL must be an http(s) URL without a user name or password", u)
		require.NotContains(t, err.Error(), "hunter2", "a password in the URL is never quoted")
	}
	_, err := relay.New(relay.Config{DB: b.env.Pool, Sink: b.sink, Schema: b.env.Schema,
		Calls: &relay.CallConfig{APIKey: "rk_live_restricted"}})
	require.NoError(t, err, "a restricted key")
	_, err = relay.New(relay.Config{DB: b.env.Pool, Sink: b.sink, Schema: b.env.Schema,
		Calls: &relay.CallConfig{APIKey: stripetest.TestKey, ReplayWindow: 23*time.Hour + 59*time.Minute}})
	require.NoError(t, err)
}

// ---- crashes of real processes -------------------------------------------------------------

const helperEnv = "TXBOX_CALL_TEST_HELPER"

// paymentHandler is the consumer under test: it records the payment and enqueues its charge in the
// inbox's transaction, then passes a failpoint where a crash loses the uncommitted transaction.
func paymentHandler(env *txtest.Env, w *outbox.Writer, replyTopic string) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		tx, _ := inbox.TxFromContext(ctx)
		var p struct {
			ID     string `json:"payment_id"`
			Amount int    `json:"amount"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return fmt.Errorf("%w: %v", inbox.ErrUnprocessable, err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+env.Q("charges")+" (payment_id, amount) VALUES ($1, $2)", p.ID, p.Amount); err != nil {
			return err
		}
		_, err := w.Call(ctx, tx, outbox.Call{
			Name: "charge", Path: "/v1/charges", ReplyTopic: replyTopic, PartitionKey: p.ID,
			Params:   url.Values{"amount": {fmt.Sprint(p.Amount)}, "currency": {"eur"}, "source": {"tok_visa"}},
			Metadata: map[string]string{"payment_id": p.ID},
		})
		if err != nil {
			return err
		}
		failpoint.HitContext(ctx, "test.consumer-after-enqueue")
		return nil
	}
}

func asHandler(h message.NoPublishHandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) }
}

func paymentRequest() *message.Message {
	return message.NewMessage("msg-pay-crash", []byte(`{"payment_id":"pay-crash","amount":4200}`))
}

// runHelperConsumer is the consumer process of TestCallSurvivesCrashes: TestMain runs it instead
// of the tests when helperEnv is set, and it dies by SIGKILL at its failpoint after enqueueing the
// call, before committing (a hook, not TXBOX_FAILPOINTS: the test binary is built without the
// failpoint build tag). It returns only if the failpoint did not fire.
func runHelperConsumer(spec string) error {
	dsn, schema, _ := strings.Cut(spec, " ")
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	env := &txtest.Env{URL: dsn, Schema: schema, Pool: pool}
	w, err := outbox.New(outbox.Config{Schema: schema})
	if err != nil {
		return err
	}
	ib, err := inbox.New(inbox.Config{DB: pool, Consumer: "payments", Schema: schema}, nil)
	if err != nil {
		return err
	}
	msg := paymentRequest()
	msg.SetContext(failpoint.WithHook(msg.Context(), "test.consumer-after-enqueue", func() {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // SIGKILL is not delivered synchronously; never run past the point.
	}))
	if _, err := ib.Middleware(asHandler(paymentHandler(env, w, "unused")))(msg); err != nil {
		return err
	}
	return errors.New("the failpoint should have killed this process")
}

// The consumer dies after enqueueing the charge but before committing; the redelivery enqueues it
// again under the same key. A relay process then dies by SIGKILL right after Stripe charged, before
// recording anything; the next relay sends the call again, Stripe replays, and it completes. That
// relay dies right after publishing the reply to Kafka, so the last relay publishes it again: the
// reply's consumer sees it twice and applies it once. One charge in all.
func TestCallSurvivesCrashes(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := context.Background()
	replyTopic := kafkatest.Topic(t)
	_, err := b.env.Pool.Exec(ctx, "CREATE TABLE "+b.env.Q("charges")+` (payment_id text PRIMARY KEY, amount bigint NOT NULL,
		status text NOT NULL DEFAULT 'pending', charge_id text, replies_applied int NOT NULL DEFAULT 0)`)
	require.NoError(t, err)

	// 1. The consumer process crashes before its commit.
	helper := exec.Command(os.Args[0])
	helper.Env = append(os.Environ(), helperEnv+"="+b.env.URL+" "+b.env.Schema)
	out, err := helper.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "%s", out)
	require.Equal(t, syscall.SIGKILL, exit.Sys().(syscall.WaitStatus).Signal(), "%s", out)
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.env.Q("charges")), "the crashed transaction left nothing")
	require.Zero(t, b.pendingCalls(t))

	// The redelivery, processed by a consumer that lives.
	ib, err := inbox.New(inbox.Config{DB: b.env.Pool, Consumer: "payments", Schema: b.env.Schema}, nil)
	require.NoError(t, err)
	handle := ib.Middleware(asHandler(paymentHandler(b.env, b.writer, replyTopic)))
	_, err = handle(paymentRequest())
	require.NoError(t, err)
	_, err = handle(paymentRequest()) // and a duplicate delivery, dropped by the inbox
	require.NoError(t, err)
	require.Equal(t, 1, b.pendingCalls(t))
	key := outbox.IdempotencyKey(outbox.Source{Consumer: "payments", DedupKey: "msg-pay-crash"}, "charge")

	// The reply's consumer, behind its own inbox.
	var deliveries atomic.Int32
	b.consumeReplies(t, replyTopic, &deliveries)

	// 2. A relay process dies by SIGKILL right after Stripe answered.
	args := []string{"relay", "--database-url", b.env.URL, "--schema", b.env.Schema,
		"--kafka-brokers", strings.Join(kafkatest.Brokers(t), ","), "--transactional-id-prefix", b.env.Schema,
		"--shards", "4", "--lease-ttl", "1s", "--poll-interval", "10ms", "--metrics-addr", "",
		"--stripe-base-url", b.stripe.URL()}
	apiKey := relay.APIKeyEnvVar + "=" + stripetest.TestKey
	crashed := proctest.Start(t, []string{apiKey, failpoint.EnvVar + "=call.after-send"}, args...)
	require.Equal(t, -1, crashed.Wait(60*time.Second), "killed at the failpoint:\n%s", crashed.Output())
	require.Equal(t, 1, b.stripe.ChargesFor(key), "Stripe charged before the crash")
	require.Equal(t, 1, b.pendingCalls(t), "nothing was recorded")
	_, done := b.result(t, key)
	require.False(t, done)

	// 3. The next relay completes the call with Stripe's replay, and dies after publishing the reply.
	second := proctest.Start(t, []string{apiKey, failpoint.EnvVar + "=relay.after-publish"}, args...)
	require.Equal(t, -1, second.Wait(60*time.Second), "killed at the failpoint:\n%s", second.Output())
	res := b.waitResult(t, key)
	require.Equal(t, 2, res.attempts)
	require.Equal(t, b.stripe.ObjectIDsFor(key), []string{res.objectID})

	// 4. The last relay publishes the reply again.
	proctest.Start(t, []string{apiKey}, args...)
	require.Eventually(t, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.env.Q("txbox_outbox")) == 0 && deliveries.Load() >= 2
	}, 60*time.Second, 20*time.Millisecond, "the reply was published twice")

	var status, chargeID string
	var applied int
	require.Eventually(t, func() bool {
		require.NoError(t, b.env.Pool.QueryRow(ctx, "SELECT status, coalesce(charge_id, ''), replies_applied FROM "+b.env.Q("charges")+
			" WHERE payment_id = 'pay-crash'").Scan(&status, &chargeID, &applied))
		return status == "done"
	}, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, res.objectID, chargeID)
	require.Equal(t, 1, applied, "the reply was applied once")
	require.Equal(t, 1, b.stripe.ChargesFor(key), "one charge")
	require.Equal(t, 1, b.stripe.TotalCharges())
	require.Equal(t, 2, b.stripe.RequestsFor(key))
}

// consumeReplies runs a read_committed Kafka consumer of topic behind an inbox that applies each
// call result to the charges table; deliveries counts every copy that reaches the inbox.
func (b *callBundle) consumeReplies(t *testing.T, topic string, deliveries *atomic.Int32) {
	t.Helper()
	ib, err := inbox.New(inbox.Config{DB: b.env.Pool, Consumer: "payment-results", Schema: b.env.Schema}, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	count := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			deliveries.Add(1)
			return h(msg)
		}
	}
	router.AddMiddleware(count, ib.Middleware)
	router.AddConsumerHandler("payment-results", topic, kafkatest.NewSubscriber(t, "results-"+b.env.Schema), func(msg *message.Message) error {
		res, err := outbox.ParseCallResult(msg)
		if err != nil {
			return fmt.Errorf("%w: %v", inbox.ErrUnprocessable, err)
		}
		tx, _ := inbox.TxFromContext(msg.Context())
		status := "done"
		if res.Outcome != outbox.OutcomeSucceeded {
			status = "failed"
		}
		_, err = tx.Exec(msg.Context(), "UPDATE "+b.env.Q("charges")+
			" SET status = $2, charge_id = $3, replies_applied = replies_applied + 1 WHERE payment_id = $1",
			res.Metadata["payment_id"], status, res.ObjectID)
		return err
	})
	txtest.RunRouter(t, router)
}

// A call the provider rejected (it stores no outcome for a request it refused) is written again
// with its explicit key and corrected parameters: it executes, its outcome replaces the rejection
// as the key's result, and its reply is not the rejection's UUID, which the consumer's inbox would
// take for a copy and drop.
func TestACallRejectedAndWrittenAgainWithItsKeyIsExecuted(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	b.startCallRelay(t, nil)
	const key = "order-17-charge"
	wrong := chargeCall(key, 1000)
	wrong.Params.Del("currency")
	// Rejected twice, its parameters still wrong the second time: each rejection replies under a
	// UUID of its own, or the consumer's inbox would drop the second as a copy of the first.
	for n := 1; n <= 2; n++ {
		b.enqueue(t, wrong)
		require.Eventually(t, func() bool { return len(b.sink.repliesWith(key, outbox.OutcomeRejected)) == n }, 30*time.Second,
			10*time.Millisecond, "rejection %d replies", n)
	}
	require.Equal(t, outbox.OutcomeRejected, b.waitResult(t, key).outcome)
	rejections := b.sink.repliesWith(key, outbox.OutcomeRejected)
	require.NotEqual(t, rejections[0].UUID, rejections[1].UUID)

	b.enqueue(t, chargeCall(key, 1000))
	require.Eventually(t, func() bool { r, _ := b.result(t, key); return r.outcome == outbox.OutcomeSucceeded }, 30*time.Second,
		10*time.Millisecond, "the corrected call's outcome is the key's result")
	require.Equal(t, 1, b.stripe.ChargesFor(key))
	require.Zero(t, b.pendingCalls(t))
	require.Eventually(t, func() bool { return len(b.sink.replies(key)) > 0 }, 30*time.Second, 10*time.Millisecond,
		"the success has its reply")
	replies := b.sink.replies(key)
	require.Len(t, replies, 1)
	res, err := outbox.ParseCallResult(replies[0].Msg)
	require.NoError(t, err)
	require.Equal(t, outbox.OutcomeSucceeded, res.Outcome)
	require.Len(t, b.sink.repliesWith(key, outbox.OutcomeRejected), 2, "the rejections had replies of their own")
}
