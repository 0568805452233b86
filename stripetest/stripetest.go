// Package stripetest is a test double of a small part of the Stripe API, for
// tests. It is not Stripe, not a Stripe client and not maintained by Stripe: it
// is an HTTP server on 127.0.0.1 that answers creating charges, payment intents
// and refunds, and retrieving them, the way txbox's authors read Stripe's
// documentation. What it adds over a stateless mock is Stripe's idempotency
// semantics (stored and replayed responses, 409 while a key is in flight,
// keys forgotten after a TTL) and fault injection (lost responses, 429, 500,
// 503, slow requests), so that a handler's or a relay's "exactly one charge
// per message" can be tested without the network, and server-side counts
// ([Server.ChargesFor]) to assert it with.
//
// Use it in tests only, and check against Stripe's test mode before relying
// on a behaviour it imitates: anything outside the endpoints listed below
// gets 404, and Stripe's real answers may differ in fields it does not fill.
//
//	double := stripetest.New(stripetest.Options{})
//	defer double.Close()
//	double.Inject(stripetest.Fault{Kind: stripetest.FaultDropAfterCharge})
//	// Point the code under test at double.URL() with stripetest.TestKey as its API key,
//	// or use double.Client(nil), a stripe-go client for the double.
//	...
//	if n := double.ChargesFor(key); n != 1 { t.Fatalf("charged %d times", n) }
//
// # Idempotency semantics
//
// The double follows Stripe's documented contract for POST requests that
// carry an Idempotency-Key header:
//
//   - The first request for a key registers the key. If the endpoint starts
//     executing, its response (2xx, a 402 card decline, or a stored 500, see
//     [Fault500Stored]) is stored and replayed verbatim for every later
//     request with the same key and the same parameters. Replayed responses
//     carry the header "Idempotent-Replayed: true" and "Original-Request" set
//     to the Request-Id of the request that produced the response.
//   - Responses produced before the endpoint started executing are not
//     stored: authentication errors (401), parameter validation errors and
//     references to unknown objects (400/404), rate limiting (429, [Fault429]),
//     transient failures ([Fault500], [Fault503]). The key stays unused and a
//     retry executes normally.
//   - The same key with different parameters gets 400 with error type
//     "idempotency_error". "Same parameters" means the same method and path,
//     the same Stripe-Account header and the same form-decoded parameter set
//     (order-independent).
//   - The same key while the first request is still executing (for example
//     during a [FaultSlow] delay) gets 409 with error type
//     "invalid_request_error" and code "idempotency_key_in_use".
//   - Keys longer than 255 characters get 400 invalid_request_error.
//   - Keys are forgotten once they are older than [Options.KeyTTL] (Stripe
//     prunes them after 24 hours); a request with a forgotten key executes
//     again and creates a second charge.
//   - POST requests without an Idempotency-Key are accepted; each one
//     executes. GET requests ignore the key.
//
// Every response carries a fresh "Request-Id" header; responses to requests
// with a key echo it in the "Idempotency-Key" header.
//
// # Endpoints
//
//   - POST /v1/charges: amount (positive integer) and currency required, and
//     source or customer; optional description, capture, metadata[k].
//     Returns a charge ("ch_...", status "succeeded", paid true). The test
//     tokens "tok_chargeDeclined" (generic_decline) and
//     "tok_chargeDeclinedInsufficientFunds", "...Fraudulent",
//     "...ExpiredCard", "...IncorrectCvc", "...ProcessingError" give 402
//     card_error with "charge" set to a failed charge object.
//   - POST /v1/payment_intents: amount and currency required; payment_method,
//     confirm, customer, description, metadata[k]. Status "succeeded" (with a
//     charge as latest_charge) when confirm=true, else
//     "requires_confirmation" ("requires_payment_method" without a
//     payment_method). "pm_card_chargeDeclined" (and the same suffixes as
//     above) give 402 card_error with the payment intent in the error.
//   - POST /v1/refunds: charge or payment_intent, optional amount (default:
//     the unrefunded rest), reason, metadata[k].
//   - GET /v1/charges/{id}, /v1/payment_intents/{id}, /v1/refunds/{id}: the
//     stored object or 404 resource_missing.
//
// Missing or invalid parameters get 400 invalid_request_error with "param"
// set. Unknown parameters are accepted and ignored (but take part in the
// idempotency comparison). Other paths get 404.
//
// # Counting
//
// The double counts server-side, so it also sees requests that a client
// library or net/http re-sent silently (net/http's Transport re-sends a
// request carrying an Idempotency-Key header when a reused keep-alive
// connection fails before the response; tests of [FaultDropAfterCharge]
// through a plain client should disable keep-alives on it to observe the
// dropped response; the relay's client sends each request once).
package stripetest

import (
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/stripe/stripe-go/v82"
)

// TestKey is an API key the double accepts when [Options.APIKey] is empty.
// Any key with the prefix "sk_test_" is accepted in that case.
const TestKey = "sk_test_stripetest"

// MaxIdempotencyKeyLength is the longest Idempotency-Key Stripe accepts.
const MaxIdempotencyKeyLength = 255

// Options configures a [Server]. The zero value is usable.
type Options struct {
	// APIKey is the only key the double accepts, as
	// "Authorization: Bearer <key>" (HTTP basic auth with the key as user
	// name is accepted too, like Stripe does). Empty accepts any key that
	// starts with "sk_test_". A missing or wrong key gets 401 with error type
	// "authentication_error".
	APIKey string
	// KeyTTL is how long idempotency keys are remembered, measured with Now
	// from the key's first request. Keys at least KeyTTL old are forgotten
	// (like Stripe pruning keys after 24h) unless a request for them is still
	// executing. 0 means keys are never forgotten.
	KeyTTL time.Duration
	// Now is the clock used for KeyTTL and for "created" timestamps.
	// Default time.Now. See [ManualClock] for a controllable clock.
	Now func() time.Time
}

// Server is a running Stripe test double. It is safe for concurrent use.
// Create it with [New] and stop it with [Server.Close].
type Server struct {
	opts      Options
	now       func() time.Time
	srv       *httptest.Server
	closing   chan struct{}
	closeOnce sync.Once

	mu      sync.Mutex
	keys    map[string]*idemEntry
	faults  []*pendingFault
	charges map[string]*chargeObj
	intents map[string]*paymentIntentObj
	refunds map[string]*refundObj

	requests     int
	requestsFor  map[string]int
	totalCharges int
	chargesFor   map[string]int
	declines     int
	declinesFor  map[string]int
	totalRefunds int
	refundsFor   map[string]int
	objectsFor   map[string][]string
}

// idemEntry is what the double remembers about one idempotency key.
type idemEntry struct {
	fingerprint       string
	created           time.Time
	inFlight          bool
	originalRequestID string
	resp              *response // nil while in flight
}

// response is a complete HTTP response as the double produces and stores it.
type response struct {
	status int
	header http.Header // headers beyond the ones every response gets
	body   []byte
}

// New starts a test double on an httptest server listening on 127.0.0.1.
func New(opts Options) *Server {
	s := &Server{
		opts:        opts,
		now:         opts.Now,
		closing:     make(chan struct{}),
		keys:        map[string]*idemEntry{},
		charges:     map[string]*chargeObj{},
		intents:     map[string]*paymentIntentObj{},
		refunds:     map[string]*refundObj{},
		requestsFor: map[string]int{},
		chargesFor:  map[string]int{},
		declinesFor: map[string]int{},
		refundsFor:  map[string]int{},
		objectsFor:  map[string][]string{},
	}
	if s.now == nil {
		s.now = time.Now
	}
	s.srv = httptest.NewUnstartedServer(http.HandlerFunc(s.serveHTTP))
	// Dropped connections and clients that time out are expected here.
	s.srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	s.srv.Start()
	return s
}

// URL is the base URL of the double, e.g. "http://127.0.0.1:43567", suitable
// for stripe.BackendConfig.URL.
func (s *Server) URL() string { return s.srv.URL }

// Close stops the server. Requests held by [FaultSlow] are released first, so
// Close does not wait for their delay. Close may be called more than once.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		close(s.closing)
		s.srv.Close()
	})
}

// Backends returns stripe-go backends that talk to the double with
// MaxNetworkRetries 0, telemetry off and logging silenced. A nil httpClient
// means a new client with the default transport, which keeps connections
// alive (and so may hide [FaultDropAfterCharge], see there).
func (s *Server) Backends(httpClient *http.Client) *stripe.Backends {
	if httpClient == nil {
		httpClient = &http.Client{}
	}
	return stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(s.URL()),
		HTTPClient:        httpClient,
		MaxNetworkRetries: stripe.Int64(0),
		EnableTelemetry:   stripe.Bool(false),
		LeveledLogger:     &stripe.LeveledLogger{Level: stripe.LevelNull},
	})
}

// Client returns a stripe-go client for the double using [Server.Backends]
// and the configured [Options.APIKey] (or [TestKey] if that is empty).
func (s *Server) Client(httpClient *http.Client) *stripe.Client {
	key := s.opts.APIKey
	if key == "" {
		key = TestKey
	}
	return stripe.NewClient(key, stripe.WithBackends(s.Backends(httpClient)))
}

// ChargesFor is the number of charges and payment intents really created by
// requests with the given idempotency key: successful POST /v1/charges and
// every POST /v1/payment_intents that created a payment intent (whatever its
// status), excluding declines (see [Server.DeclinesFor]). Replays do not
// count. ChargesFor("") counts those created by requests without a key.
// The count survives the key being forgotten after [Options.KeyTTL].
func (s *Server) ChargesFor(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.chargesFor[key]
}

// TotalCharges is the sum of [Server.ChargesFor] over all keys.
func (s *Server) TotalCharges() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.totalCharges
}

// Declines is the number of declined charge attempts (402 card_error from
// POST /v1/charges or POST /v1/payment_intents). A declined attempt still
// creates a charge object with status "failed", but it is not counted by
// [Server.ChargesFor] or [Server.TotalCharges]. Replays do not count.
func (s *Server) Declines() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.declines
}

// DeclinesFor is [Server.Declines] restricted to one idempotency key.
func (s *Server) DeclinesFor(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.declinesFor[key]
}

// Refunds is the number of refunds created. Replays do not count.
func (s *Server) Refunds() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.totalRefunds
}

// RefundsFor is [Server.Refunds] restricted to one idempotency key.
func (s *Server) RefundsFor(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refundsFor[key]
}

// ObjectIDsFor lists, in creation order, the IDs of all objects (charges
// including failed ones, payment intents, refunds) created by executions of
// requests with the given idempotency key.
func (s *Server) ObjectIDsFor(key string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.objectsFor[key])
}

// Requests is the number of HTTP requests received, of any kind: including
// replays, rejected requests and requests hit by a fault.
func (s *Server) Requests() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requests
}

// RequestsFor is the number of HTTP requests received whose Idempotency-Key
// header (trimmed of spaces) equals key. RequestsFor("") counts requests
// without a key.
func (s *Server) RequestsFor(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requestsFor[key]
}

// InFlight reports whether a request with this idempotency key is executing,
// i.e. whether a concurrent request with the key would get 409
// idempotency_key_in_use. Use it with require.Eventually to wait until a
// [FaultSlow] request has reached the double.
func (s *Server) InFlight(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	return e != nil && e.inFlight
}

// serveHTTP is the single entry point: authentication, fault injection,
// idempotency, dispatch and delivery of the response.
func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	key := strings.TrimSpace(r.Header.Get("Idempotency-Key"))
	reqID := newID("req_", 14)

	s.mu.Lock()
	s.requests++
	s.requestsFor[key]++
	s.mu.Unlock()

	h := w.Header()
	h.Set("Request-Id", reqID)
	h.Set("Content-Type", "application/json")
	if v := r.Header.Get("Stripe-Version"); v != "" {
		h.Set("Stripe-Version", v)
	}
	if key != "" {
		h.Set("Idempotency-Key", key)
	}

	if res, ok := s.authenticate(r); !ok {
		writeResponse(w, res)
		return
	}
	if len(key) > MaxIdempotencyKeyLength {
		writeResponse(w, errorResponse(http.StatusBadRequest, apiError{
			Type:    "invalid_request_error",
			Message: "Idempotency-Key must be at most 255 characters long.",
		}))
		return
	}
	if err := r.ParseForm(); err != nil {
		writeResponse(w, errorResponse(http.StatusBadRequest, apiError{
			Type:    "invalid_request_error",
			Message: "Invalid request body: " + err.Error(),
		}))
		return
	}

	f, hasFault := s.takeFault(key, r.URL.Path)
	if hasFault {
		switch f.Kind {
		case Fault429:
			writeResponse(w, rateLimitResponse(f.RetryAfter))
			return
		case Fault503:
			writeResponse(w, unavailableResponse())
			return
		case Fault500:
			writeResponse(w, serverErrorResponse(true))
			return
		}
	}

	res, entry, replayed := s.dispatch(r, key, reqID, hasFault && f.Kind == Fault500Stored)

	if hasFault && f.Kind == FaultSlow {
		s.wait(f)
	}
	if entry != nil {
		s.mu.Lock()
		entry.resp = &res
		entry.inFlight = false
		s.mu.Unlock()
	}
	if hasFault && f.Kind == FaultDropAfterCharge {
		dropConnection(w)
		return
	}
	if entry != nil {
		h.Set("Original-Request", reqID)
	}
	if replayed != "" {
		h.Set("Idempotent-Replayed", "true")
		h.Set("Original-Request", replayed)
	}
	writeResponse(w, res)
}

// dispatch applies idempotency and runs the endpoint. It returns the
// response, the entry the response must be stored in once delivered (nil if
// it must not be stored), and the original Request-Id if res is a replay.
func (s *Server) dispatch(r *http.Request, key, reqID string, fail500 bool) (res response, entry *idemEntry, replayedFrom string) {
	rt := route(r.Method, r.URL.Path)
	if rt == nil {
		return errorResponse(http.StatusNotFound, apiError{
			Type: "invalid_request_error",
			Message: "Unrecognized request URL (" + r.Method + ": " + r.URL.Path +
				"). Please see https://stripe.com/docs or we can help at https://support.stripe.com/.",
		}), nil, ""
	}

	s.mu.Lock()
	defer s.mu.Unlock()

	if r.Method == http.MethodGet {
		return rt.get(s), nil, ""
	}

	fp := fingerprint(r)
	if key != "" {
		s.pruneLocked(key)
		if e := s.keys[key]; e != nil {
			switch {
			case e.fingerprint != fp:
				return errorResponse(http.StatusBadRequest, apiError{
					Type: "idempotency_error",
					Message: "Keys for idempotent requests can only be used with the same parameters they were first used with. " +
						"Try using a key other than '" + key + "' if you meant to execute a different request.",
				}), nil, ""
			case e.inFlight:
				return errorResponse(http.StatusConflict, apiError{
					Type: "invalid_request_error",
					Code: "idempotency_key_in_use",
					Message: "There is currently another in-progress request using this Idempotent Key " +
						"(that probably means you submitted twice, and the other request is still going through): " + key +
						". Please try again later.",
				}), nil, ""
			default:
				return *e.resp, nil, e.originalRequestID
			}
		}
	}

	run, errRes, ok := rt.post(s, r.Form)
	if !ok {
		return errRes, nil, ""
	}
	if key != "" {
		entry = &idemEntry{
			fingerprint:       fp,
			created:           s.now(),
			inFlight:          true,
			originalRequestID: reqID,
		}
		s.keys[key] = entry
	}
	if fail500 {
		return serverErrorResponse(false), entry, ""
	}
	return run(key), entry, ""
}

// pruneLocked forgets key if it is older than KeyTTL and not executing.
func (s *Server) pruneLocked(key string) {
	if s.opts.KeyTTL <= 0 {
		return
	}
	e := s.keys[key]
	if e != nil && !e.inFlight && s.now().Sub(e.created) >= s.opts.KeyTTL {
		delete(s.keys, key)
	}
}

// authenticate checks the API key. ok is false if res must be sent instead.
func (s *Server) authenticate(r *http.Request) (res response, ok bool) {
	var key string
	if auth := r.Header.Get("Authorization"); auth != "" {
		if k, found := strings.CutPrefix(auth, "Bearer "); found {
			key = strings.TrimSpace(k)
		} else if user, _, basic := r.BasicAuth(); basic {
			key = user
		}
	}
	switch {
	case key == "":
		res = errorResponse(http.StatusUnauthorized, apiError{
			Type: "authentication_error",
			Message: "You did not provide an API key. You need to provide your API key in the Authorization header, " +
				"using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY').",
		})
	case s.opts.APIKey != "" && key != s.opts.APIKey,
		s.opts.APIKey == "" && !strings.HasPrefix(key, "sk_test_"):
		res = errorResponse(http.StatusUnauthorized, apiError{
			Type:    "authentication_error",
			Message: "Invalid API Key provided: " + redactKey(key),
		})
	default:
		return response{}, true
	}
	res.header = http.Header{"Www-Authenticate": {`Bearer realm="Stripe"`}}
	return res, false
}

func redactKey(key string) string {
	if len(key) <= 12 {
		return strings.Repeat("*", len(key))
	}
	return key[:8] + strings.Repeat("*", len(key)-12) + key[len(key)-4:]
}

// wait holds a FaultSlow request until its Delay passed, its Release channel
// is closed, or the server is closing, whichever comes first. The client
// going away does not shorten the wait: like Stripe, the double finishes the
// request regardless.
func (s *Server) wait(f Fault) {
	var timeout <-chan time.Time
	if f.Delay > 0 {
		t := time.NewTimer(f.Delay)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-timeout:
	case <-f.Release:
	case <-s.closing:
	}
}

// dropConnection closes the client connection without writing a response.
func dropConnection(w http.ResponseWriter) {
	hj, ok := w.(http.Hijacker)
	if !ok {
		panic(http.ErrAbortHandler)
	}
	conn, _, err := hj.Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	_ = conn.Close()
}

func writeResponse(w http.ResponseWriter, res response) {
	for k, vs := range res.header {
		w.Header()[k] = slices.Clone(vs)
	}
	w.WriteHeader(res.status)
	_, _ = w.Write(res.body)
}

const idAlphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

// newID returns prefix followed by n random base62 characters.
func newID(prefix string, n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = idAlphabet[rand.IntN(len(idAlphabet))]
	}
	return prefix + string(b)
}
