package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/stripe/stripe-go/v82"

	"github.com/txbox/txbox/outbox"
)

// Reasons the relay records with the dead letters of calls; stable, for filtering and alerting.
const (
	// ReasonCallTooOld: the call's first attempt is older than CallConfig.ReplayWindow. Stripe may
	// have forgotten its key, so sending it again could execute it twice; a person must find out
	// whether an earlier attempt went through.
	ReasonCallTooOld = "call replay window passed"
	// ReasonIdempotencyMismatch: the provider had seen the key with other parameters. Retrying
	// cannot help and a new key could execute the call twice.
	ReasonIdempotencyMismatch = "idempotency key reused with other parameters"
	// ReasonCallIndeterminate: the provider failed after it started executing and replays that
	// failure for the key (a stored 500, or Stripe-Should-Retry: false). Whether it had an effect
	// is unknown.
	ReasonCallIndeterminate = "call outcome indeterminate"
	// ReasonInvalidCall: the stored call cannot be sent (undecodable, unknown provider).
	ReasonInvalidCall = "invalid call"
	// ReasonReplyUnwritable: the call completed, and its result is stored, but the outbox refuses
	// its reply (the call's metadata, which the reply carries, makes it larger than the outbox
	// takes): the reply is the letter.
	ReasonReplyUnwritable = "reply cannot be written"
)

// DefaultStripeURL is CallConfig.BaseURL when it is not specified.
const DefaultStripeURL = "https://api.stripe.com"

// verdictKind is what the relay does with a call after a send.
type verdictKind int

const (
	verdictDone    verdictKind = iota // an outcome: store it, reply, delete the row
	verdictRetry                      // send again later with the same key
	verdictDead                       // never send again: dead letter
	verdictAbandon                    // the lease ended mid-call: leave the row to the next owner
)

// verdict is the classification of one send.
type verdict struct {
	kind       verdictKind
	result     outbox.CallResult // Outcome, HTTPStatus, ObjectID, Object, Status, Error when done
	body       []byte
	retryAfter time.Duration // the provider's Retry-After, when it sent one
	reason     string        // the dead-letter reason when dead
	detail     string        // what happened, for last_error, logs and the dead letter
	httpStatus int           // the response's status, 0 when none came
}

func (v verdict) label() string {
	switch v.kind {
	case verdictDone:
		return v.result.Outcome
	case verdictRetry:
		return "retry"
	case verdictDead:
		return "dead"
	}
	return "abandoned"
}

// stripeClient sends stored calls through stripe-go with the relay's own retry policy: stripe-go's
// network retries are off, so that every attempt is counted, spaced and bounded by the replay
// window here.
type stripeClient struct {
	api stripe.Backend
	key string
}

func newStripeClient(c *CallConfig) *stripeClient {
	client := *c.HTTPClient
	base := client.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	client.Transport = observingTransport{base}
	b := stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(c.BaseURL),
		HTTPClient:        &client,
		MaxNetworkRetries: stripe.Int64(0),
		EnableTelemetry:   stripe.Bool(false),
		LeveledLogger:     &stripe.LeveledLogger{Level: stripe.LevelNull},
	})
	return &stripeClient{api: b.API, key: c.APIKey}
}

// object captures the fields of a response the relay reports, and the response itself.
type object struct {
	ID     string `json:"id"`
	Object string `json:"object"`
	Status string `json:"status"`
	resp   *stripe.APIResponse
}

func (o *object) SetLastResponse(r *stripe.APIResponse) { o.resp = r }

// wire is what the transport saw of the response, whatever stripe-go made of it: a proxy's HTML
// 502 never becomes a *stripe.Error, and a 2xx whose body does not decode is still a call that ran.
type wire struct {
	mu     sync.Mutex
	status int
	header http.Header
}

type wireKey struct{}

type observingTransport struct{ base http.RoundTripper }

func (t observingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.GetBody != nil {
		// net/http resends by itself a request it can replay (its body can be had again) that
		// carries an Idempotency-Key, when a kept-alive connection breaks before the response:
		// the provider would see an attempt the relay never counted, logged or spaced. A copy
		// without GetBody is sent once.
		once := *req
		once.GetBody = nil
		req = &once
	}
	res, err := t.base.RoundTrip(req)
	if w, ok := req.Context().Value(wireKey{}).(*wire); ok && res != nil {
		w.mu.Lock()
		w.status, w.header = res.StatusCode, res.Header.Clone()
		w.mu.Unlock()
	}
	return res, err
}

// send sends req once with key and classifies the answer. ctx bounds the request; leaseCtx ending
// means the lease is gone and nothing may be concluded.
func (s *stripeClient) send(ctx, leaseCtx context.Context, key string, req outbox.CallRequest) verdict {
	if req.Provider != outbox.ProviderStripe {
		return verdict{kind: verdictDead, reason: ReasonInvalidCall, detail: fmt.Sprintf("unknown provider %q", req.Provider)}
	}
	if req.Method != http.MethodPost && req.Method != http.MethodDelete || !strings.HasPrefix(req.Path, "/v1/") {
		return verdict{kind: verdictDead, reason: ReasonInvalidCall, detail: fmt.Sprintf("cannot send %s %s", req.Method, req.Path)}
	}
	w := &wire{}
	params := &stripe.Params{Context: context.WithValue(ctx, wireKey{}, w), IdempotencyKey: stripe.String(key)}
	if req.StripeAccount != "" {
		params.StripeAccount = stripe.String(req.StripeAccount)
	}
	var obj object
	err := s.api.CallRaw(req.Method, req.Path, s.key, []byte(req.Params.Encode()), params, &obj)
	w.mu.Lock()
	defer w.mu.Unlock()
	v := classify(err, &obj, w, ctx, leaseCtx)
	v.httpStatus = w.status
	return s.withoutKey(v)
}

// keyMask stands for the API key wherever an answer quoted it.
const keyMask = "[" + APIKeyEnvVar + "]"

// withoutKey masks the API key in everything of v that is logged or stored: the detail (logs,
// last_error, dead letters), the error message and the body (call results, replies). Stripe masks
// a key it quotes ("sk_test_****1234"), but whatever answers at the base URL may not: a proxy or a
// double that echoes the Authorization header put the key in the log and the database.
func (s *stripeClient) withoutKey(v verdict) verdict {
	if s.key == "" {
		return v
	}
	v.detail = strings.ReplaceAll(v.detail, s.key, keyMask)
	if e := v.result.Error; e != nil && strings.Contains(e.Message, s.key) {
		masked := *e
		masked.Message = strings.ReplaceAll(e.Message, s.key, keyMask)
		v.result.Error = &masked
	}
	if bytes.Contains(v.body, []byte(s.key)) {
		v.body = bytes.ReplaceAll(v.body, []byte(s.key), []byte(keyMask))
	}
	return v
}

// classify turns the result of one send into what to do about it. The rule: only an answer the
// provider stored for the key is an outcome; anything that a retry with the same key may change is
// retried; anything a retry cannot change and that is not an outcome goes to a person.
func classify(err error, obj *object, w *wire, ctx, leaseCtx context.Context) verdict {
	if err == nil || obj.resp != nil && obj.resp.StatusCode/100 == 2 {
		// A 2xx whose body did not decode still ran: it is done, with the body as it came.
		v := verdict{kind: verdictDone, result: outbox.CallResult{
			Outcome: outbox.OutcomeSucceeded, ObjectID: obj.ID, Object: obj.Object, Status: obj.Status,
		}}
		if obj.resp != nil {
			v.result.HTTPStatus, v.body = obj.resp.StatusCode, obj.resp.RawJSON
		}
		return v
	}
	if leaseCtx.Err() != nil {
		return verdict{kind: verdictAbandon, detail: "lease ended during the call: " + err.Error()}
	}

	var se *stripe.Error
	if !errors.As(err, &se) {
		v := verdict{kind: verdictRetry, detail: err.Error()}
		switch {
		case ctx.Err() != nil:
			v.detail = "no answer within the request deadline: " + err.Error()
		case w.status != 0:
			v.detail = fmt.Sprintf("HTTP %d with a body that is not a Stripe answer: %v", w.status, err)
			v.retryAfter = retryAfter(w.header)
		}
		return v
	}

	status := se.HTTPStatusCode
	var header http.Header
	var body []byte
	if se.LastResponse != nil {
		header, body = se.LastResponse.Header, se.LastResponse.RawJSON
	}
	detail := fmt.Sprintf("HTTP %d %s", status, describe(se))
	callErr := &outbox.CallError{Type: string(se.Type), Code: string(se.Code), DeclineCode: string(se.DeclineCode), Param: se.Param, Message: se.Msg}
	switch {
	case se.Type == stripe.ErrorTypeIdempotency:
		return verdict{kind: verdictDead, reason: ReasonIdempotencyMismatch, detail: detail}
	case status == http.StatusConflict, se.Code == stripe.ErrorCodeIdempotencyKeyInUse:
		// Another request with the key is still running (a relay that lost its lease, or our own
		// attempt that timed out): its answer will be replayed to a later attempt.
		return verdict{kind: verdictRetry, detail: detail, retryAfter: retryAfter(header)}
	case status == http.StatusTooManyRequests, status == http.StatusRequestTimeout:
		return verdict{kind: verdictRetry, detail: detail, retryAfter: retryAfter(header)}
	case status >= 500:
		if header.Get("Idempotent-Replayed") == "true" || header.Get("Stripe-Should-Retry") == "false" {
			return verdict{kind: verdictDead, reason: ReasonCallIndeterminate, detail: detail +
				" (the provider stored this failure for the key: every retry gets it replayed, and whether the call had an effect is unknown)"}
		}
		return verdict{kind: verdictRetry, detail: detail, retryAfter: retryAfter(header)}
	case status == http.StatusUnauthorized, status == http.StatusForbidden:
		// A bad or restricted API key is fixed by an operator; nothing was executed or stored.
		return verdict{kind: verdictRetry, detail: detail + " (check the relay's STRIPE_API_KEY)"}
	case status == http.StatusPaymentRequired, se.Type == stripe.ErrorTypeCard:
		id := se.ChargeID
		if id == "" && se.PaymentIntent != nil {
			id = se.PaymentIntent.ID
		}
		return verdict{kind: verdictDone, body: body, detail: detail, result: outbox.CallResult{
			Outcome: outbox.OutcomeDeclined, HTTPStatus: status, ObjectID: id, Error: callErr,
		}}
	case status >= 400:
		return verdict{kind: verdictDone, body: body, detail: detail, result: outbox.CallResult{
			Outcome: outbox.OutcomeRejected, HTTPStatus: status, Error: callErr,
		}}
	}
	return verdict{kind: verdictRetry, detail: detail}
}

func describe(se *stripe.Error) string {
	parts := []string{string(se.Type)}
	if se.Code != "" {
		parts = append(parts, string(se.Code))
	}
	if se.DeclineCode != "" {
		parts = append(parts, string(se.DeclineCode))
	}
	s := strings.Join(parts, "/")
	if se.Msg != "" {
		s += ": " + se.Msg
	}
	if se.RequestID != "" {
		s += " (request " + se.RequestID + ")"
	}
	return s
}

// retryAfter reads a Retry-After header in seconds or as an HTTP date; 0 when absent.
func retryAfter(h http.Header) time.Duration {
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseFloat(v, 64); err == nil && secs > 0 {
		return time.Duration(secs * float64(time.Second))
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}

// bounded returns body for storing: whole when it is at most limit bytes, else cut at limit and
// flagged, so a huge response never bloats the result table or the reply.
func bounded(body []byte, limit int) (kept []byte, truncated bool) {
	if len(body) <= limit {
		return body, false
	}
	return body[:limit], true
}

// replyBody is the body for CallResult.Body: only complete JSON, since a cut document does not
// parse.
func replyBody(body []byte, limit int) (json.RawMessage, bool) {
	kept, truncated := bounded(body, limit)
	if truncated || len(kept) == 0 || !json.Valid(kept) {
		return nil, truncated
	}
	return json.RawMessage(kept), false
}
