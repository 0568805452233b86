package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/metrics"
	"github.com/txbox/txbox/outbox"
)

// APIKeyEnvVar is the environment variable the Stripe API key is read from when CallConfig.APIKey
// is empty.
const APIKeyEnvVar = "STRIPE_API_KEY"

// Defaults for CallConfig.
const (
	DefaultReplayWindow    = 23 * time.Hour
	DefaultCallBatchSize   = 16
	DefaultCallConcurrency = 4
	DefaultCallPoll        = 100 * time.Millisecond
	DefaultMinCallBackoff  = time.Second
	DefaultMaxCallBackoff  = 5 * time.Minute
	DefaultMaxResultBytes  = 16 << 10
)

// providerKeyLifetime is how long Stripe is known to keep an idempotency key.
const providerKeyLifetime = 24 * time.Hour

// CallConfig configures the execution of side-effect calls (Config.Calls). Zero values mean the
// documented defaults.
type CallConfig struct {
	// APIKey is the Stripe secret key. If not specified, it is read from the STRIPE_API_KEY
	// environment variable, which is where it should come from: never from a flag or a file in
	// version control. One of the two is required.
	APIKey string
	// BaseURL is the Stripe API's address. If not specified, defaults to DefaultStripeURL; point it
	// at a test double (package stripetest) or stripe-mock in tests.
	BaseURL string
	// HTTPClient sends the requests. If not specified, a client on http.DefaultTransport. Its
	// Transport is wrapped, never modified.
	HTTPClient *http.Client
	// Timeout bounds one request. If not specified, defaults to two thirds of the relay's LeaseTTL,
	// so that a graceful handover (which waits one LeaseTTL for work in flight) never cuts a call
	// off. Longer is safe — a call cut off is sent again with its key — but
	// txbox_side_effect_duration_seconds should stay below LeaseTTL. At most ReplayWindow.
	Timeout time.Duration
	// ReplayWindow is the oldest a call's idempotency key may be when the call is sent, counted from
	// the first attempt of any call with that key (an explicit key can be written twice). An older
	// call goes to the dead-letter table for a person to reconcile, because Stripe may have
	// forgotten its key (it keeps keys for 24 hours). It must be below 24h. If not specified,
	// defaults to 23h.
	ReplayWindow time.Duration
	// MinBackoff and MaxBackoff bound the wait before a failed call is tried again: exponential in
	// its attempts, with jitter, and never shorter than the provider's Retry-After. MinBackoff is
	// between 1ms and 1h and MaxBackoff at most 24h; if not specified, they default to 1s and 5m.
	MinBackoff, MaxBackoff time.Duration
	// BatchSize is the most due calls of a shard read at once. Between 1 and 1000; if not
	// specified, defaults to 16.
	BatchSize int
	// Concurrency is the most calls of one shard in flight at once. Between 1 and 100; if not
	// specified, defaults to 4.
	Concurrency int
	// PollInterval is how long a shard without due calls waits before looking again. Between 1ms
	// and 1m (shorter would keep a query running without pause); if not specified, defaults to
	// 100ms.
	PollInterval time.Duration
	// MaxResultBytes bounds the copy of a response body kept in txbox_call_result and the reply.
	// At most 64 MiB; if not specified, defaults to 16 KiB.
	MaxResultBytes int
}

// apiKeyProblem says what is wrong with a Stripe API key, or "" if nothing is, without quoting it:
// it goes in an HTTP header, and only a secret or a restricted key may make calls. Caught here, a
// pasted key with a trailing newline or the publishable key stops the relay at start-up rather
// than failing every call, retried forever.
func apiKeyProblem(key string) string {
	for _, r := range key {
		if r <= ' ' || r > '~' {
			return "contains a space, a control character (a trailing newline?) or non-ASCII text"
		}
	}
	switch {
	case strings.HasPrefix(key, "pk_"):
		return "is a publishable key (pk_...); the relay needs a secret key (sk_...) or a restricted key (rk_...)"
	case !strings.HasPrefix(key, "sk_") && !strings.HasPrefix(key, "rk_"):
		return "is not a secret key (sk_...) or a restricted key (rk_...)"
	}
	return ""
}

// resolve returns c with its defaults filled in for a relay with leaseTTL, or an error naming the
// first bad setting.
func (c CallConfig) resolve(leaseTTL time.Duration) (CallConfig, error) {
	if c.APIKey == "" {
		c.APIKey = os.Getenv(APIKeyEnvVar)
	}
	if c.APIKey == "" {
		return c, fmt.Errorf("relay: CallConfig.APIKey: no Stripe API key; set the %s environment variable", APIKeyEnvVar)
	}
	if problem := apiKeyProblem(c.APIKey); problem != "" {
		return c, fmt.Errorf("relay: CallConfig.APIKey: the Stripe API key (%s) %s", APIKeyEnvVar, problem)
	}
	if c.BaseURL == "" {
		c.BaseURL = DefaultStripeURL
	}
	if strings.Contains(c.BaseURL, "@") {
		// A user or password would only be logged: stripe-go's Authorization header wins over it.
		return c, errors.New("relay: CallConfig.BaseURL must be an http(s) URL without a user name or password (the value is not shown)")
	}
	if u, err := url.Parse(c.BaseURL); err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return c, fmt.Errorf("relay: CallConfig.BaseURL %q is not an http(s) URL", c.BaseURL)
	}
	if c.HTTPClient == nil {
		c.HTTPClient = &http.Client{}
	}
	var err error
	setting(&err, "CallConfig.ReplayWindow", &c.ReplayWindow, DefaultReplayWindow, 1, providerKeyLifetime-1)
	setting(&err, "CallConfig.Timeout", &c.Timeout, leaseTTL*2/3, 1, c.ReplayWindow)
	setting(&err, "CallConfig.MinBackoff", &c.MinBackoff, DefaultMinCallBackoff, time.Millisecond, time.Hour)
	setting(&err, "CallConfig.MaxBackoff", &c.MaxBackoff, max(DefaultMaxCallBackoff, c.MinBackoff), c.MinBackoff, 24*time.Hour)
	setting(&err, "CallConfig.BatchSize", &c.BatchSize, DefaultCallBatchSize, 1, 1000)
	setting(&err, "CallConfig.Concurrency", &c.Concurrency, DefaultCallConcurrency, 1, 100)
	setting(&err, "CallConfig.PollInterval", &c.PollInterval, DefaultCallPoll, time.Millisecond, time.Minute)
	setting(&err, "CallConfig.MaxResultBytes", &c.MaxResultBytes, DefaultMaxResultBytes, 1, 64<<20)
	return c, err
}

// callRow is one due call.
type callRow struct {
	id           int64
	replyTopic   string
	partitionKey string
	uuid         string
	payload      []byte
	metadata     string
	key          string
}

// caller executes the calls of one lease.
type caller struct {
	l       *lease
	cfg     CallConfig
	client  *stripeClient
	replies *outbox.Writer
	m       *metrics.Calls

	failures int // consecutive failed cycles (database trouble), for backoff and logging once
}

// runCalls executes the shard's call rows until the lease ends; true means the lease was fenced.
func (l *lease) runCalls() bool {
	r := l.relay
	cfg := *r.cfg.Calls
	replies, err := outbox.New(outbox.Config{Schema: r.cfg.Schema})
	if err != nil {
		// The schema was validated by New; this cannot fail.
		r.log.Error("cannot execute calls", "shard", l.shard, "error", err)
		return false
	}
	c := &caller{l: l, cfg: cfg, client: newStripeClient(&cfg), replies: replies, m: metrics.NewCalls(r.cfg.Registerer, r.cfg.Schema)}
	defer r.calling.settle(l.shard, 0)
	for {
		select {
		case <-l.stop:
			return false
		case <-l.ctx.Done():
			return false
		default:
		}
		n, err := c.cycle()
		switch {
		case errors.Is(err, ErrFenced):
			return true
		case err != nil && l.ctx.Err() != nil:
			return false
		case err != nil:
			c.failures++
			r.calling.fail(l.shard, err)
			l.wait(backoff(c.failures))
		default:
			if c.failures > 0 {
				r.calling.settle(l.shard, c.failures)
				c.failures = 0
			}
			// A batch holds one call per key, so a key with a backlog of calls has its next one
			// due at once: only an empty look waits.
			if n == 0 {
				l.wait(cfg.PollInterval)
			}
		}
	}
}

// cycle executes one batch of due calls, up to Concurrency at once. Calls in one batch never share
// a partition key (readCalls returns the first pending call of each key), so running them side by
// side keeps per-key order.
func (c *caller) cycle() (int, error) {
	l, r := c.l, c.l.relay
	var batch []callRow
	err := r.read(l.ctx, r.sql.readCalls, []any{l.slots, c.cfg.BatchSize}, func(rows pgx.Rows) (err error) {
		batch, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (callRow, error) {
			var p callRow
			err := row.Scan(&p.id, &p.replyTopic, &p.partitionKey, &p.uuid, &p.payload, &p.metadata, &p.key)
			return p, err
		})
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("relay: read calls of shard %d: %w", l.shard, err)
	}

	var (
		mu       sync.Mutex
		firstErr error
		wg       sync.WaitGroup
		sem      = make(chan struct{}, c.cfg.Concurrency)
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if firstErr == nil || errors.Is(err, ErrFenced) {
			firstErr = err
		}
	}
	failed := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return firstErr != nil
	}
loop:
	for _, row := range batch {
		select {
		case sem <- struct{}{}:
		case <-l.stop: // graceful stop: finish what is in flight, start nothing new
			break loop
		case <-l.ctx.Done():
			break loop
		}
		if failed() {
			<-sem
			break loop
		}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := c.execute(row); err != nil {
				fail(err)
			}
		})
	}
	wg.Wait()
	return len(batch), firstErr
}

// execute runs one call through the three steps of the package comment. It returns an error only
// when the lease is fenced or the database failed; the call's own failures are handled here.
func (c *caller) execute(row callRow) error {
	l, r := c.l, c.l.relay
	// The deadline starts before the age check, so that however long the check takes, the send
	// cannot begin later than the check allowed.
	started := time.Now()

	var req outbox.CallRequest
	if err := json.Unmarshal(row.payload, &req); err != nil {
		return c.bury(row, 0, ReasonInvalidCall, fmt.Sprintf("undecodable call payload: %v", err))
	}

	var (
		attempts int
		first    time.Time
		ageMs    int64
		tooOld   bool
	)
	err := l.fenced(l.ctx, func(tx pgx.Tx) error {
		err := tx.QueryRow(l.ctx, r.sql.startCall, row.id).Scan(&attempts, &first, &ageMs)
		if err != nil {
			return err
		}
		buriedFirst, ok, err := r.dead.CallFirstSent(l.ctx, tx, row.key)
		if err != nil {
			return err
		}
		if ok && buriedFirst.Before(first) {
			ageMs += first.Sub(buriedFirst).Milliseconds()
			first = buriedFirst
		}
		if age := time.Duration(ageMs) * time.Millisecond; age >= c.cfg.ReplayWindow {
			tooOld = true
			return c.buryTx(tx, row, attempts-1, ReasonCallTooOld, fmt.Sprintf(
				"idempotency key %q was first sent at %s (by this call, or an earlier call with the same key, pending, done or dead-lettered), %s ago, beyond the %s replay window: "+
					"Stripe may have forgotten it, so sending the call now could execute it twice. "+
					"Look the key up in the Stripe dashboard (Developers > Logs) to learn whether an earlier attempt went through, settle the outcome by hand, "+
					"and if it must still happen, write it as a new call with a new key; never redrive this letter as it is.",
				row.key, first.UTC().Format(time.RFC3339), age.Round(time.Second), c.cfg.ReplayWindow))
		}
		return nil
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // Settled meanwhile (by a person, say): nothing to send.
	}
	if err != nil {
		return err
	}
	if tooOld {
		c.m.Results.WithLabelValues("dead").Inc()
		r.metrics.DeadLetters.WithLabelValues(string(dlq.SourceRelay), ReasonCallTooOld).Inc()
		r.log.Error("call is older than the replay window; moved to the dead-letter table for reconciliation, not sent",
			"shard", l.shard, "idempotency_key", row.key, "call", req.Name, "first_attempt_at", first)
		return nil
	}

	left := c.cfg.ReplayWindow - time.Duration(ageMs)*time.Millisecond
	sendCtx, cancel := context.WithDeadline(l.ctx, started.Add(min(c.cfg.Timeout, left)))
	defer cancel()

	failpoint.HitContext(l.ctx, "call.before-send")
	spanCtx, span := c.startCallSpan(sendCtx, row, req, attempts)
	c.m.InFlight.Inc()
	sent := time.Now()
	v := c.client.send(spanCtx, l.ctx, row.key, req)
	took := time.Since(sent)
	c.m.InFlight.Dec()
	endCallSpan(span, v)
	c.m.Duration.WithLabelValues(v.label()).Observe(took.Seconds())
	failpoint.HitContext(l.ctx, "call.after-send")

	switch v.kind {
	case verdictAbandon:
		c.m.Results.WithLabelValues(v.label()).Inc()
		return nil
	case verdictDead:
		if v.reason == ReasonIdempotencyMismatch {
			c.m.IdempotencyErrors.Inc()
		}
		if err := c.bury(row, attempts, v.reason, v.detail); err != nil {
			return err
		}
		c.m.Results.WithLabelValues(v.label()).Inc()
		return nil
	case verdictRetry:
		wait := c.retryIn(attempts, v.retryAfter)
		err := l.fenced(l.ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(l.ctx, r.sql.rescheduleCall, row.id, wait.Milliseconds(), v.detail)
			return err
		})
		if err != nil {
			return err
		}
		c.m.Results.WithLabelValues(v.label()).Inc()
		// One line per failing call, not one per retry: the row's last_error has the latest.
		if attempts == 1 {
			r.log.Warn("call failed; retrying with the same idempotency key", "shard", l.shard,
				"idempotency_key", row.key, "call", req.Name, "error", v.detail, "retry_in", wait.Round(time.Millisecond))
		}
		return nil
	}

	if err := c.complete(row, req, v, attempts, first, took); err != nil {
		return err
	}
	failpoint.HitContext(l.ctx, "call.after-complete")
	c.m.Results.WithLabelValues(v.label()).Inc()
	if attempts > 1 {
		r.log.Info("call completed after retries", "shard", l.shard, "idempotency_key", row.key,
			"call", req.Name, "attempts", attempts, "outcome", v.result.Outcome)
	}
	return nil
}

// complete records the outcome, writes the reply and deletes the row, in one fenced transaction.
func (c *caller) complete(row callRow, req outbox.CallRequest, v verdict, attempts int, first time.Time, took time.Duration) error {
	l, r := c.l, c.l.relay
	var meta map[string]string
	_ = json.Unmarshal([]byte(row.metadata), &meta) // Written by the outbox from a map: it decodes.
	res := v.result
	res.CallUUID, res.IdempotencyKey, res.Name, res.Attempts, res.Metadata = row.uuid, row.key, req.Name, attempts, meta
	res.Body, res.BodyTruncated = replyBody(v.body, c.cfg.MaxResultBytes)
	kept, _ := bounded(v.body, c.cfg.MaxResultBytes)
	// A text column takes neither invalid UTF-8 (a cut multi-byte character, a proxy's bytes) nor NUL.
	stored := strings.ReplaceAll(strings.ToValidUTF8(string(kept), "\uFFFD"), "\x00", "")

	var (
		unwritable error
		buried     bool
	)
	err := l.fenced(l.ctx, func(tx pgx.Tx) error {
		tag, err := tx.Exec(l.ctx, r.sql.deleteRows, []int64{row.id})
		if err != nil {
			return err
		}
		// The lease is still ours, so no relay settled the row: an operator buried it while the
		// request was at the provider (Admin.Bury cannot stop a send under way). The provider's
		// answer is kept and replied all the same, after the burial's reply: whoever reconciles
		// the letter, and the application, must learn that the call was done. The result keeps a
		// key's first stored outcome, as for any call.
		buried = tag.RowsAffected() == 0
		if _, err := tx.Exec(l.ctx, r.sql.insertCallResult, row.key, row.uuid, res.Outcome, res.HTTPStatus,
			res.ObjectID, stored, attempts, took.Milliseconds(), first); err != nil {
			return err
		}
		msg, err := writeReply(l.ctx, c.replies, tx, row.id, row.replyTopic, row.partitionKey, res)
		if !errors.Is(err, outbox.ErrInvalidMessage) {
			return err
		}
		// Retrying cannot make the reply writable, and the call is done: its reply is the letter,
		// so the shard is not held up by a completion that fails every time.
		unwritable = err
		return r.dead.Add(l.ctx, tx, dlq.Entry{
			Source: dlq.SourceRelay, Topic: row.replyTopic, PartitionKey: row.partitionKey, UUID: msg.UUID,
			Payload: msg.Payload, Metadata: meta, Reason: ReasonReplyUnwritable, Error: err.Error(), Attempts: attempts,
		})
	})
	if err == nil && unwritable != nil {
		r.metrics.DeadLetters.WithLabelValues(string(dlq.SourceRelay), ReasonReplyUnwritable).Inc()
		r.log.Error("the reply of a completed call moved to the dead-letter table", "shard", l.shard,
			"idempotency_key", row.key, "reason", ReasonReplyUnwritable, "error", unwritable)
	}
	if err == nil && buried {
		r.log.Error("a call buried while its request was at the provider was answered: the answer is stored and replied; reconcile its letter with it",
			"shard", l.shard, "idempotency_key", row.key, "outcome", res.Outcome, "object_id", res.ObjectID)
	}
	return err
}

// writeReply writes, in tx, the reply message of the call stored as outbox row row that ended with
// res to the call's reply topic, keyed by its partition key, and returns it; nil and no error when
// the call asked for none.
func writeReply(ctx context.Context, w *outbox.Writer, tx pgx.Tx, row int64, replyTopic, partitionKey string, res outbox.CallResult) (*message.Message, error) {
	if replyTopic == "" {
		return nil, nil
	}
	payload, err := json.Marshal(res)
	if err != nil {
		return nil, err
	}
	var id string
	switch res.Outcome {
	case outbox.OutcomeRejected:
		id = outbox.RejectedReplyUUID(res.IdempotencyKey, row)
	case outbox.OutcomeDeadLettered:
		id = outbox.DeadLetteredReplyUUID(res.IdempotencyKey, row)
	default:
		id = outbox.ReplyUUID(res.IdempotencyKey)
	}
	msg := message.NewMessage(id, payload)
	for k, val := range res.Metadata {
		msg.Metadata.Set(k, val)
	}
	outbox.SetPartitionKey(msg, partitionKey)
	return msg, w.Publish(ctx, tx, replyTopic, msg)
}

// replyDeadLettered writes, in tx, the reply of the call stored as outbox row row, moved to the
// dead-letter table as letter, whether by the relay or by an operator (Admin.Bury): whoever waits
// for the reply learns that the relay will not do the call. A reply the outbox refuses is left out:
// the letter, which the call's reply topic names, stands for it.
func replyDeadLettered(ctx context.Context, w *outbox.Writer, tx pgx.Tx, row int64, letter dlq.Entry) error {
	var name string
	var req outbox.CallRequest
	if json.Unmarshal(letter.Payload, &req) == nil {
		name = req.Name
	}
	_, err := writeReply(ctx, w, tx, row, letter.Topic, letter.PartitionKey, outbox.CallResult{
		CallUUID: letter.UUID, IdempotencyKey: letter.IdempotencyKey, Name: name, Outcome: outbox.OutcomeDeadLettered,
		Error: &outbox.CallError{Code: letter.Reason, Message: letter.Error}, Attempts: letter.Attempts, Metadata: letter.Metadata,
	})
	if errors.Is(err, outbox.ErrInvalidMessage) {
		return nil
	}
	return err
}

// bury moves a call to the dead-letter table in its own fenced transaction.
func (c *caller) bury(row callRow, attempts int, reason, detail string) error {
	err := c.l.fenced(c.l.ctx, func(tx pgx.Tx) error { return c.buryTx(tx, row, attempts, reason, detail) })
	if err != nil {
		return err
	}
	c.l.relay.metrics.DeadLetters.WithLabelValues(string(dlq.SourceRelay), reason).Inc()
	c.l.relay.log.Error("call moved to the dead-letter table; it will not be sent again", "shard", c.l.shard,
		"idempotency_key", row.key, "reason", reason, "error", detail)
	return nil
}

func (c *caller) buryTx(tx pgx.Tx, row callRow, attempts int, reason, detail string) error {
	l, r := c.l, c.l.relay
	first, ok, err := r.deleteForBurial(l.ctx, tx, row.id)
	if err != nil || !ok {
		return err
	}
	var meta map[string]string
	_ = json.Unmarshal([]byte(row.metadata), &meta)
	letter := dlq.Entry{
		Source: dlq.SourceRelay, Kind: "call", Topic: row.replyTopic, PartitionKey: row.partitionKey,
		UUID: row.uuid, Payload: row.payload, Metadata: meta, IdempotencyKey: row.key,
		Reason: reason, Error: detail, Attempts: attempts, FirstFailedAt: first,
	}
	if err := r.dead.Add(l.ctx, tx, letter); err != nil {
		return err
	}
	return replyDeadLettered(l.ctx, c.replies, tx, row.id, letter)
}

// retryIn is the wait before the next attempt: exponential in the call's durable attempt count,
// so it survives restarts and takeovers, and never shorter than the provider asked for.
func (c *caller) retryIn(attempts int, retryAfter time.Duration) time.Duration {
	return retryDelay(c.cfg.MinBackoff, c.cfg.MaxBackoff, attempts, retryAfter)
}
