package stripetest_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/txbox/txbox/stripetest"
)

// ---- helpers ----------------------------------------------------------------

func newServer(t *testing.T, opts stripetest.Options) *stripetest.Server {
	t.Helper()
	s := stripetest.New(opts)
	t.Cleanup(s.Close)
	return s
}

// newClient builds a stripe-go v82 client the way txbox does, explicitly.
func newClient(s *stripetest.Server, key string, hc *http.Client) *stripe.Client {
	if hc == nil {
		hc = &http.Client{}
	}
	b := stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(s.URL()),
		HTTPClient:        hc,
		MaxNetworkRetries: stripe.Int64(0),
		LeveledLogger:     &stripe.LeveledLogger{Level: stripe.LevelNull},
	})
	return stripe.NewClient(key, stripe.WithBackends(b))
}

func noKeepAlive(timeout time.Duration) *http.Client {
	return &http.Client{
		Timeout:   timeout,
		Transport: &http.Transport{DisableKeepAlives: true},
	}
}

func chargeParams(key string, amount int64) *stripe.ChargeCreateParams {
	p := &stripe.ChargeCreateParams{
		Amount:      stripe.Int64(amount),
		Currency:    stripe.String("usd"),
		Source:      &stripe.PaymentSourceSourceParams{Token: stripe.String("tok_visa")},
		Description: stripe.String("outbox message"),
	}
	p.AddMetadata("outbox_id", "42")
	if key != "" {
		p.SetIdempotencyKey(key)
	}
	return p
}

func stripeErr(t *testing.T, err error) *stripe.Error {
	t.Helper()
	var se *stripe.Error
	require.ErrorAs(t, err, &se)
	return se
}

type rawResult struct {
	status int
	header http.Header
	body   map[string]any
}

func (r rawResult) errField(name string) any {
	e, _ := r.body["error"].(map[string]any)
	return e[name]
}

// rawPost sends a form-encoded POST with plain net/http. key "" sends no
// Idempotency-Key header; authKey "" sends no Authorization header.
func rawPost(t *testing.T, s *stripetest.Server, path, authKey, key, form string, hdr map[string]string) rawResult {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, s.URL()+path, strings.NewReader(form))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if authKey != "" {
		req.Header.Set("Authorization", "Bearer "+authKey)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var body map[string]any
	require.NoError(t, json.Unmarshal(raw, &body), string(raw))
	require.NotEmpty(t, resp.Header.Get("Request-Id"))
	return rawResult{status: resp.StatusCode, header: resp.Header, body: body}
}

// ---- wire format --------------------------------------------------------------

func TestChargeCreateAndRetrieve(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := newClient(s, stripetest.TestKey, nil)
	ctx := context.Background()

	ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-1", 1500))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(ch.ID, "ch_"), ch.ID)
	require.Equal(t, "charge", ch.Object)
	require.EqualValues(t, 1500, ch.Amount)
	require.Equal(t, stripe.CurrencyUSD, ch.Currency)
	require.Equal(t, stripe.ChargeStatusSucceeded, ch.Status)
	require.True(t, ch.Paid)
	require.True(t, ch.Captured)
	require.Equal(t, "outbox message", ch.Description)
	require.Equal(t, map[string]string{"outbox_id": "42"}, ch.Metadata)
	require.NotNil(t, ch.Source)
	require.Equal(t, stripe.PaymentSourceTypeCard, ch.Source.Type)
	require.Equal(t, "4242", ch.Source.Card.Last4)
	require.True(t, strings.HasPrefix(ch.LastResponse.RequestID, "req_"))
	require.Equal(t, "msg-1", ch.LastResponse.IdempotencyKey)
	require.Empty(t, ch.LastResponse.Header.Get("Idempotent-Replayed"))

	got, err := sc.V1Charges.Retrieve(ctx, ch.ID, nil)
	require.NoError(t, err)
	require.Equal(t, ch.ID, got.ID)
	require.EqualValues(t, 1500, got.Amount)

	_, err = sc.V1Charges.Retrieve(ctx, "ch_doesnotexist", nil)
	se := stripeErr(t, err)
	require.Equal(t, http.StatusNotFound, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorTypeInvalidRequest, se.Type)
	require.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)

	require.Equal(t, 1, s.ChargesFor("msg-1"))
	require.Equal(t, 1, s.TotalCharges())
	require.Equal(t, 3, s.Requests())
	require.Equal(t, 1, s.RequestsFor("msg-1"))
	require.Equal(t, []string{ch.ID}, s.ObjectIDsFor("msg-1"))
}

func TestMissingParamIsNotStored(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	p := chargeParams("msg-missing", 100)
	p.Amount = nil
	_, err := sc.V1Charges.Create(ctx, p)
	se := stripeErr(t, err)
	require.Equal(t, http.StatusBadRequest, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorTypeInvalidRequest, se.Type)
	require.Equal(t, "amount", se.Param)
	require.Equal(t, stripe.ErrorCodeParameterMissing, se.Code)

	p = chargeParams("msg-missing", 100)
	p.Currency = nil
	_, err = sc.V1Charges.Create(ctx, p)
	require.Equal(t, "currency", stripeErr(t, err).Param)

	p = chargeParams("msg-missing", 100)
	p.Source = nil
	_, err = sc.V1Charges.Create(ctx, p)
	require.Equal(t, "source", stripeErr(t, err).Param)

	// The endpoint never started executing, so the key is still unused: a
	// corrected request with the same key executes (no idempotency_error).
	ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-missing", 100))
	require.NoError(t, err)
	require.Empty(t, ch.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, 1, s.ChargesFor("msg-missing"))
}

func TestAuthentication(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	s := newServer(t, stripetest.Options{APIKey: "sk_test_right"})
	_, err := newClient(s, "sk_test_wrong", nil).V1Charges.Create(ctx, chargeParams("k", 100))
	se := stripeErr(t, err)
	require.Equal(t, http.StatusUnauthorized, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorType("authentication_error"), se.Type)
	require.Equal(t, 0, s.TotalCharges())

	// A 401 is not stored: the key is still usable.
	_, err = newClient(s, "sk_test_right", nil).V1Charges.Create(ctx, chargeParams("k", 100))
	require.NoError(t, err)

	open := newServer(t, stripetest.Options{})
	_, err = newClient(open, "sk_test_anything", nil).V1Charges.Create(ctx, chargeParams("k", 100))
	require.NoError(t, err)
	_, err = newClient(open, "sk_live_nope", nil).V1Charges.Create(ctx, chargeParams("k2", 100))
	require.Equal(t, http.StatusUnauthorized, stripeErr(t, err).HTTPStatusCode)

	res := rawPost(t, open, "/v1/charges", "", "k3", "amount=100&currency=usd&source=tok_visa", nil)
	require.Equal(t, http.StatusUnauthorized, res.status)
	require.Equal(t, "authentication_error", res.errField("type"))
}

// ---- idempotency ------------------------------------------------------------

func TestReplaySameKey(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	first, err := sc.V1Charges.Create(ctx, chargeParams("msg-replay", 2000))
	require.NoError(t, err)
	second, err := sc.V1Charges.Create(ctx, chargeParams("msg-replay", 2000))
	require.NoError(t, err)

	require.Equal(t, first.ID, second.ID)
	require.Equal(t, "true", second.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, first.LastResponse.RequestID, second.LastResponse.Header.Get("Original-Request"))
	require.NotEqual(t, first.LastResponse.RequestID, second.LastResponse.RequestID)
	require.Equal(t, 1, s.ChargesFor("msg-replay"))
	require.Equal(t, 1, s.TotalCharges())
	require.Equal(t, 2, s.RequestsFor("msg-replay"))
}

func TestReplayIgnoresParameterOrder(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})

	a := rawPost(t, s, "/v1/charges", stripetest.TestKey, "order",
		"amount=100&currency=usd&source=tok_visa&metadata[a]=1&metadata[b]=2", nil)
	require.Equal(t, http.StatusOK, a.status)
	b := rawPost(t, s, "/v1/charges", stripetest.TestKey, "order",
		"metadata[b]=2&source=tok_visa&metadata[a]=1&currency=usd&amount=100", nil)
	require.Equal(t, http.StatusOK, b.status)
	require.Equal(t, a.body["id"], b.body["id"])
	require.Equal(t, "true", b.header.Get("Idempotent-Replayed"))
	require.Equal(t, 1, s.ChargesFor("order"))
}

func TestIdempotencyErrorOnDifferentParams(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	_, err := sc.V1Charges.Create(ctx, chargeParams("msg-params", 1000))
	require.NoError(t, err)

	_, err = sc.V1Charges.Create(ctx, chargeParams("msg-params", 1001))
	se := stripeErr(t, err)
	require.Equal(t, stripe.ErrorTypeIdempotency, se.Type)
	require.Equal(t, http.StatusBadRequest, se.HTTPStatusCode)
	var ie *stripe.IdempotencyError
	require.ErrorAs(t, err, &ie)

	// Same parameters for another connected account: also a different request.
	p := chargeParams("msg-params", 1000)
	p.SetStripeAccount("acct_other")
	_, err = sc.V1Charges.Create(ctx, p)
	require.Equal(t, stripe.ErrorTypeIdempotency, stripeErr(t, err).Type)

	// Same key on another endpoint.
	_, err = sc.V1PaymentIntents.Create(ctx, &stripe.PaymentIntentCreateParams{
		Params:   stripe.Params{IdempotencyKey: stripe.String("msg-params")},
		Amount:   stripe.Int64(1000),
		Currency: stripe.String("usd"),
	})
	require.Equal(t, stripe.ErrorTypeIdempotency, stripeErr(t, err).Type)

	require.Equal(t, 1, s.ChargesFor("msg-params"))
	require.Equal(t, 4, s.RequestsFor("msg-params"))
}

func TestInFlightKeyGets409(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	release := make(chan struct{})
	s.Inject(stripetest.Fault{Kind: stripetest.FaultSlow, Key: "msg-busy", Release: release})

	type result struct {
		ch  *stripe.Charge
		err error
	}
	done := make(chan result, 1)
	go func() {
		ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-busy", 700))
		done <- result{ch, err}
	}()
	require.Eventually(t, func() bool { return s.InFlight("msg-busy") }, 5*time.Second, 5*time.Millisecond)

	_, err := sc.V1Charges.Create(ctx, chargeParams("msg-busy", 700))
	se := stripeErr(t, err)
	require.Equal(t, http.StatusConflict, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorTypeInvalidRequest, se.Type)
	require.Equal(t, stripe.ErrorCodeIdempotencyKeyInUse, se.Code)

	// Other keys are not blocked.
	_, err = sc.V1Charges.Create(ctx, chargeParams("msg-other", 700))
	require.NoError(t, err)

	close(release)
	first := <-done
	require.NoError(t, first.err)
	require.False(t, s.InFlight("msg-busy"))

	again, err := sc.V1Charges.Create(ctx, chargeParams("msg-busy", 700))
	require.NoError(t, err)
	require.Equal(t, first.ch.ID, again.ID)
	require.Equal(t, "true", again.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, 1, s.ChargesFor("msg-busy"))
	require.Equal(t, 3, s.RequestsFor("msg-busy"))
}

func TestConcurrentSameKeyChargesOnce(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	const n = 16
	var wg sync.WaitGroup
	ids := make(chan string, n)
	for range n {
		wg.Go(func() {
			ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-race", 300))
			if err != nil {
				var se *stripe.Error
				if errors.As(err, &se) && se.Code == stripe.ErrorCodeIdempotencyKeyInUse {
					return
				}
				t.Errorf("unexpected error: %v", err)
				return
			}
			ids <- ch.ID
		})
	}
	wg.Wait()
	close(ids)
	var distinct []string
	for id := range ids {
		if len(distinct) == 0 || distinct[0] != id {
			distinct = append(distinct, id)
		}
	}
	require.Len(t, distinct, 1)
	require.Equal(t, 1, s.ChargesFor("msg-race"))
	require.Equal(t, n, s.RequestsFor("msg-race"))
}

func TestNoIdempotencyKeyChargesEveryTime(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	form := "amount=100&currency=usd&source=tok_visa"
	a := rawPost(t, s, "/v1/charges", stripetest.TestKey, "", form, nil)
	b := rawPost(t, s, "/v1/charges", stripetest.TestKey, "", form, nil)
	require.Equal(t, http.StatusOK, a.status)
	require.Equal(t, http.StatusOK, b.status)
	require.NotEqual(t, a.body["id"], b.body["id"])
	require.Equal(t, 2, s.ChargesFor(""))
	require.Equal(t, 2, s.RequestsFor(""))
	require.Equal(t, 2, s.TotalCharges())
}

func TestIdempotencyKeyTooLong(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	long := strings.Repeat("k", stripetest.MaxIdempotencyKeyLength+1)
	res := rawPost(t, s, "/v1/charges", stripetest.TestKey, long, "amount=100&currency=usd&source=tok_visa", nil)
	require.Equal(t, http.StatusBadRequest, res.status)
	require.Equal(t, "invalid_request_error", res.errField("type"))
	require.Equal(t, 0, s.TotalCharges())

	ok := rawPost(t, s, "/v1/charges", stripetest.TestKey, long[:stripetest.MaxIdempotencyKeyLength],
		"amount=100&currency=usd&source=tok_visa", nil)
	require.Equal(t, http.StatusOK, ok.status)
}

// ---- faults -------------------------------------------------------------------

func TestDropAfterCharge(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	// Keep-alives off: otherwise net/http may silently re-send the request
	// on a reused connection and hide the drop.
	sc := s.Client(noKeepAlive(0))
	ctx := context.Background()

	s.Inject(stripetest.Fault{Kind: stripetest.FaultDropAfterCharge, Key: "msg-drop"})
	_, err := sc.V1Charges.Create(ctx, chargeParams("msg-drop", 900))
	require.Error(t, err)
	var se *stripe.Error
	require.False(t, errors.As(err, &se), "want a connection error, got a Stripe error: %v", err)
	require.Equal(t, 1, s.ChargesFor("msg-drop"), "the charge happened before the connection dropped")
	require.Equal(t, 1, s.RequestsFor("msg-drop"))

	ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-drop", 900))
	require.NoError(t, err)
	require.Equal(t, "true", ch.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, []string{ch.ID}, s.ObjectIDsFor("msg-drop"))
	require.Equal(t, 1, s.ChargesFor("msg-drop"))
	require.Equal(t, 0, s.PendingFaults())
}

// With keep-alives on, the drop on a reused connection is retried by
// net/http itself (the request has an Idempotency-Key header): the caller
// sees a replayed success and only the double's counters reveal the retry.
func TestDropAfterChargeHiddenByKeepAlive(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(&http.Client{Transport: &http.Transport{}})
	ctx := context.Background()

	_, err := sc.V1Charges.Create(ctx, chargeParams("warm-up", 100)) // leaves an idle connection
	require.NoError(t, err)

	s.Inject(stripetest.Fault{Kind: stripetest.FaultDropAfterCharge, Key: "msg-hidden"})
	ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-hidden", 100))
	require.NoError(t, err)
	require.Equal(t, "true", ch.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, 2, s.RequestsFor("msg-hidden"))
	require.Equal(t, 1, s.ChargesFor("msg-hidden"))
}

func TestSlowResponseBeyondClientTimeout(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	ctx := context.Background()
	impatient := s.Client(&http.Client{Timeout: 100 * time.Millisecond})
	patient := s.Client(nil)

	release := make(chan struct{})
	s.Inject(stripetest.Fault{Kind: stripetest.FaultSlow, Key: "msg-slow", Release: release})

	_, err := impatient.V1Charges.Create(ctx, chargeParams("msg-slow", 1200))
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout(), "want a timeout, got %v", err)
	require.Equal(t, 1, s.ChargesFor("msg-slow"), "the charge happens even though the client gave up")

	// The double is still "executing" the first request.
	require.True(t, s.InFlight("msg-slow"))
	_, err = patient.V1Charges.Create(ctx, chargeParams("msg-slow", 1200))
	require.Equal(t, stripe.ErrorCodeIdempotencyKeyInUse, stripeErr(t, err).Code)

	close(release)
	require.Eventually(t, func() bool { return !s.InFlight("msg-slow") }, 5*time.Second, 5*time.Millisecond)

	ch, err := patient.V1Charges.Create(ctx, chargeParams("msg-slow", 1200))
	require.NoError(t, err)
	require.Equal(t, "true", ch.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, []string{ch.ID}, s.ObjectIDsFor("msg-slow"))
	require.Equal(t, 1, s.ChargesFor("msg-slow"))
}

func TestSlowWithDelay(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	ctx := context.Background()

	s.Inject(stripetest.Fault{Kind: stripetest.FaultSlow, Key: "msg-delay", Delay: 300 * time.Millisecond})
	_, err := s.Client(&http.Client{Timeout: 50 * time.Millisecond}).V1Charges.Create(ctx, chargeParams("msg-delay", 10))
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout())

	require.Eventually(t, func() bool { return !s.InFlight("msg-delay") }, 5*time.Second, 5*time.Millisecond)
	ch, err := s.Client(nil).V1Charges.Create(ctx, chargeParams("msg-delay", 10))
	require.NoError(t, err)
	require.Equal(t, "true", ch.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, 1, s.ChargesFor("msg-delay"))
}

func TestCloseReleasesSlowRequests(t *testing.T) {
	t.Parallel()
	s := stripetest.New(stripetest.Options{})
	s.Inject(stripetest.Fault{Kind: stripetest.FaultSlow, Delay: time.Hour})

	done := make(chan error, 1)
	go func() {
		_, err := s.Client(nil).V1Charges.Create(context.Background(), chargeParams("msg-close", 100))
		done <- err
	}()
	require.Eventually(t, func() bool { return s.InFlight("msg-close") }, 5*time.Second, 5*time.Millisecond)
	s.Close() // must not wait an hour
	s.Close() // idempotent
	<-done
	require.Equal(t, 1, s.ChargesFor("msg-close"))
}

func TestRateLimited429(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	s.Inject(stripetest.Fault{Kind: stripetest.Fault429, Key: "msg-429", RetryAfter: 2500 * time.Millisecond})
	_, err := sc.V1Charges.Create(ctx, chargeParams("msg-429", 100))
	se := stripeErr(t, err)
	require.Equal(t, http.StatusTooManyRequests, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorCodeRateLimit, se.Code)
	require.Equal(t, "3", se.LastResponse.Header.Get("Retry-After"))
	require.Equal(t, 0, s.ChargesFor("msg-429"))

	ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-429", 100))
	require.NoError(t, err)
	require.Empty(t, ch.LastResponse.Header.Get("Idempotent-Replayed"), "a 429 is not stored")
	require.Equal(t, 1, s.ChargesFor("msg-429"))
}

func TestUnavailable503NotRetriedByStripeGo(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	ctx := context.Background()
	b := stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(s.URL()),
		MaxNetworkRetries: stripe.Int64(2),
		LeveledLogger:     &stripe.LeveledLogger{Level: stripe.LevelNull},
	})
	sc := stripe.NewClient(stripetest.TestKey, stripe.WithBackends(b))

	s.Inject(stripetest.Fault{Kind: stripetest.Fault503, Key: "msg-503"})
	_, err := sc.V1Charges.Create(ctx, chargeParams("msg-503", 100))
	se := stripeErr(t, err)
	require.Equal(t, http.StatusServiceUnavailable, se.HTTPStatusCode)
	require.Equal(t, "true", se.LastResponse.Header.Get("Stripe-Should-Retry"))
	require.Equal(t, 1, s.RequestsFor("msg-503"), "stripe-go does not retry a 503 Stripe error")
	require.Equal(t, 0, s.ChargesFor("msg-503"))

	ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-503", 100))
	require.NoError(t, err)
	require.Empty(t, ch.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, 1, s.ChargesFor("msg-503"))
}

func TestTransient500ThenSuccess(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	s.Inject(stripetest.Fault{Kind: stripetest.Fault500, Key: "msg-500"})
	_, err := sc.V1Charges.Create(ctx, chargeParams("msg-500", 100))
	se := stripeErr(t, err)
	require.Equal(t, http.StatusInternalServerError, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorTypeAPI, se.Type)
	require.Equal(t, "true", se.LastResponse.Header.Get("Stripe-Should-Retry"))
	require.Equal(t, 0, s.ChargesFor("msg-500"))

	ch, err := sc.V1Charges.Create(ctx, chargeParams("msg-500", 100))
	require.NoError(t, err)
	require.Empty(t, ch.LastResponse.Header.Get("Idempotent-Replayed"), "a transient 500 is not stored")
	require.Equal(t, 1, s.ChargesFor("msg-500"))
}

func TestStored500IsReplayed(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	s.Inject(stripetest.Fault{Kind: stripetest.Fault500Stored, Key: "msg-500s"})
	_, err := sc.V1Charges.Create(ctx, chargeParams("msg-500s", 100))
	first := stripeErr(t, err)
	require.Equal(t, http.StatusInternalServerError, first.HTTPStatusCode)
	require.Equal(t, stripe.ErrorTypeAPI, first.Type)
	require.Equal(t, "false", first.LastResponse.Header.Get("Stripe-Should-Retry"))
	require.Empty(t, first.LastResponse.Header.Get("Idempotent-Replayed"))

	for range 2 {
		_, err = sc.V1Charges.Create(ctx, chargeParams("msg-500s", 100))
		again := stripeErr(t, err)
		require.Equal(t, http.StatusInternalServerError, again.HTTPStatusCode)
		require.Equal(t, first.Msg, again.Msg)
		require.Equal(t, "true", again.LastResponse.Header.Get("Idempotent-Replayed"))
		require.Equal(t, first.RequestID, again.LastResponse.Header.Get("Original-Request"))
	}
	require.Equal(t, 0, s.ChargesFor("msg-500s"))
	require.Equal(t, 3, s.RequestsFor("msg-500s"))

	// Only a new key gets the charge through.
	_, err = sc.V1Charges.Create(ctx, chargeParams("msg-500s-2", 100))
	require.NoError(t, err)
	require.Equal(t, 1, s.TotalCharges())
}

func TestFaultMatching(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	require.Panics(t, func() { s.Inject(stripetest.Fault{}) })
	require.Panics(t, func() { s.Inject(stripetest.Fault{Kind: stripetest.FaultSlow}) })

	s.Inject(stripetest.Fault{Kind: stripetest.Fault503, Key: "a", Count: 2})
	s.Inject(stripetest.Fault{Kind: stripetest.Fault429, Path: "/v1/refunds"})
	require.Equal(t, 2, s.PendingFaults())

	_, err := sc.V1Charges.Create(ctx, chargeParams("b", 100)) // other key: unaffected
	require.NoError(t, err)
	for range 2 {
		_, err = sc.V1Charges.Create(ctx, chargeParams("a", 100))
		require.Equal(t, http.StatusServiceUnavailable, stripeErr(t, err).HTTPStatusCode)
	}
	_, err = sc.V1Charges.Create(ctx, chargeParams("a", 100))
	require.NoError(t, err)
	require.Equal(t, 1, s.PendingFaults())

	s.ClearFaults()
	require.Equal(t, 0, s.PendingFaults())

	// Empty Key matches any request, Count < 0 matches until cleared.
	s.Inject(stripetest.Fault{Kind: stripetest.Fault500, Count: -1})
	for _, key := range []string{"c", "d"} {
		_, err = sc.V1Charges.Create(ctx, chargeParams(key, 100))
		require.Equal(t, http.StatusInternalServerError, stripeErr(t, err).HTTPStatusCode)
	}
	require.Equal(t, 1, s.PendingFaults())
	s.ClearFaults()
	require.Equal(t, 2, s.TotalCharges())
}

// ---- clock / TTL ----------------------------------------------------------------

func TestKeyTTLForgetsKeys(t *testing.T) {
	t.Parallel()
	clock := stripetest.NewManualClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	s := newServer(t, stripetest.Options{KeyTTL: 24 * time.Hour, Now: clock.Now})
	sc := s.Client(nil)
	ctx := context.Background()

	first, err := sc.V1Charges.Create(ctx, chargeParams("msg-ttl", 100))
	require.NoError(t, err)
	require.Equal(t, clock.Now().Unix(), first.Created)

	clock.Advance(23*time.Hour + 59*time.Minute)
	replay, err := sc.V1Charges.Create(ctx, chargeParams("msg-ttl", 100))
	require.NoError(t, err)
	require.Equal(t, first.ID, replay.ID)
	require.Equal(t, 1, s.ChargesFor("msg-ttl"))

	// After the window the key is gone and the same request charges again:
	// this is why the relay must never send a message after the key window.
	clock.Advance(time.Minute)
	second, err := sc.V1Charges.Create(ctx, chargeParams("msg-ttl", 100))
	require.NoError(t, err)
	require.NotEqual(t, first.ID, second.ID)
	require.Empty(t, second.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, 2, s.ChargesFor("msg-ttl"))

	// Forgotten keys can also be reused with other parameters.
	clock.Advance(24 * time.Hour)
	_, err = sc.V1Charges.Create(ctx, chargeParams("msg-ttl", 999))
	require.NoError(t, err)
	require.Equal(t, 3, s.ChargesFor("msg-ttl"))
}

// ---- declines, payment intents, refunds ---------------------------------------

func TestDeclinedCard(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	p := chargeParams("msg-decline", 100)
	p.Source = &stripe.PaymentSourceSourceParams{Token: stripe.String("tok_chargeDeclined")}
	_, err := sc.V1Charges.Create(ctx, p)
	se := stripeErr(t, err)
	require.Equal(t, http.StatusPaymentRequired, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorTypeCard, se.Type)
	require.Equal(t, stripe.ErrorCodeCardDeclined, se.Code)
	require.Equal(t, stripe.DeclineCodeGenericDecline, se.DeclineCode)
	require.True(t, strings.HasPrefix(se.ChargeID, "ch_"), se.ChargeID)
	var ce *stripe.CardError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, 1, s.Declines())
	require.Equal(t, 1, s.DeclinesFor("msg-decline"))
	require.Equal(t, 0, s.ChargesFor("msg-decline"))
	require.Equal(t, 0, s.TotalCharges())

	// The decline is stored and replayed like any executed request.
	_, err = sc.V1Charges.Create(ctx, p)
	again := stripeErr(t, err)
	require.Equal(t, se.ChargeID, again.ChargeID)
	require.Equal(t, "true", again.LastResponse.Header.Get("Idempotent-Replayed"))
	require.Equal(t, 1, s.Declines())

	failed, err := sc.V1Charges.Retrieve(ctx, se.ChargeID, nil)
	require.NoError(t, err)
	require.Equal(t, stripe.ChargeStatusFailed, failed.Status)
	require.False(t, failed.Paid)
	require.Equal(t, "card_declined", failed.FailureCode)
}

func TestPaymentIntents(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	params := func(key, pm string, confirm bool) *stripe.PaymentIntentCreateParams {
		p := &stripe.PaymentIntentCreateParams{
			Amount:        stripe.Int64(4200),
			Currency:      stripe.String("eur"),
			PaymentMethod: stripe.String(pm),
			Confirm:       stripe.Bool(confirm),
		}
		p.SetIdempotencyKey(key)
		return p
	}

	pi, err := sc.V1PaymentIntents.Create(ctx, params("pi-ok", "pm_card_visa", true))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(pi.ID, "pi_"), pi.ID)
	require.Equal(t, stripe.PaymentIntentStatusSucceeded, pi.Status)
	require.EqualValues(t, 4200, pi.AmountReceived)
	require.NotNil(t, pi.LatestCharge)
	require.Equal(t, 1, s.ChargesFor("pi-ok"))

	ch, err := sc.V1Charges.Retrieve(ctx, pi.LatestCharge.ID, nil)
	require.NoError(t, err)
	require.Equal(t, pi.ID, ch.PaymentIntent.ID)

	replay, err := sc.V1PaymentIntents.Create(ctx, params("pi-ok", "pm_card_visa", true))
	require.NoError(t, err)
	require.Equal(t, pi.ID, replay.ID)
	require.Equal(t, 1, s.ChargesFor("pi-ok"))

	pending, err := sc.V1PaymentIntents.Create(ctx, params("pi-pending", "pm_card_visa", false))
	require.NoError(t, err)
	require.Equal(t, stripe.PaymentIntentStatusRequiresConfirmation, pending.Status)

	got, err := sc.V1PaymentIntents.Retrieve(ctx, pending.ID, nil)
	require.NoError(t, err)
	require.Equal(t, pending.ID, got.ID)
	_, err = sc.V1PaymentIntents.Retrieve(ctx, "pi_missing", nil)
	require.Equal(t, http.StatusNotFound, stripeErr(t, err).HTTPStatusCode)

	_, err = sc.V1PaymentIntents.Create(ctx, params("pi-declined", "pm_card_chargeDeclined", true))
	se := stripeErr(t, err)
	require.Equal(t, http.StatusPaymentRequired, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorTypeCard, se.Type)
	require.Equal(t, stripe.ErrorCodeCardDeclined, se.Code)
	require.NotNil(t, se.PaymentIntent)
	require.Equal(t, stripe.PaymentIntentStatusRequiresPaymentMethod, se.PaymentIntent.Status)
	require.Equal(t, 1, s.DeclinesFor("pi-declined"))
	require.Equal(t, 0, s.ChargesFor("pi-declined"))

	_, err = sc.V1PaymentIntents.Create(ctx, &stripe.PaymentIntentCreateParams{Currency: stripe.String("eur")})
	require.Equal(t, "amount", stripeErr(t, err).Param)
}

func TestRefunds(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	sc := s.Client(nil)
	ctx := context.Background()

	ch, err := sc.V1Charges.Create(ctx, chargeParams("refund-src", 1000))
	require.NoError(t, err)

	rp := &stripe.RefundCreateParams{Charge: stripe.String(ch.ID), Amount: stripe.Int64(400)}
	rp.SetIdempotencyKey("refund-1")
	rf, err := sc.V1Refunds.Create(ctx, rp)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(rf.ID, "re_"), rf.ID)
	require.EqualValues(t, 400, rf.Amount)
	require.Equal(t, ch.ID, rf.Charge.ID)
	require.Equal(t, stripe.RefundStatusSucceeded, rf.Status)

	again, err := sc.V1Refunds.Create(ctx, rp)
	require.NoError(t, err)
	require.Equal(t, rf.ID, again.ID)
	require.Equal(t, 1, s.RefundsFor("refund-1"))
	gotRefund, err := sc.V1Refunds.Retrieve(ctx, rf.ID, nil)
	require.NoError(t, err)
	require.EqualValues(t, 400, gotRefund.Amount)

	got, err := sc.V1Charges.Retrieve(ctx, ch.ID, nil)
	require.NoError(t, err)
	require.EqualValues(t, 400, got.AmountRefunded)
	require.False(t, got.Refunded)

	over := &stripe.RefundCreateParams{Charge: stripe.String(ch.ID), Amount: stripe.Int64(601)}
	_, err = sc.V1Refunds.Create(ctx, over)
	require.Equal(t, http.StatusBadRequest, stripeErr(t, err).HTTPStatusCode)

	_, err = sc.V1Refunds.Create(ctx, &stripe.RefundCreateParams{Charge: stripe.String(ch.ID)})
	require.NoError(t, err)
	got, err = sc.V1Charges.Retrieve(ctx, ch.ID, nil)
	require.NoError(t, err)
	require.True(t, got.Refunded)

	_, err = sc.V1Refunds.Create(ctx, &stripe.RefundCreateParams{Charge: stripe.String("ch_missing")})
	se := stripeErr(t, err)
	require.Equal(t, http.StatusNotFound, se.HTTPStatusCode)
	require.Equal(t, stripe.ErrorCodeResourceMissing, se.Code)

	pp := &stripe.PaymentIntentCreateParams{
		Amount: stripe.Int64(500), Currency: stripe.String("usd"),
		PaymentMethod: stripe.String("pm_card_visa"), Confirm: stripe.Bool(true),
	}
	pi, err := sc.V1PaymentIntents.Create(ctx, pp)
	require.NoError(t, err)
	byPI, err := sc.V1Refunds.Create(ctx, &stripe.RefundCreateParams{PaymentIntent: stripe.String(pi.ID)})
	require.NoError(t, err)
	require.EqualValues(t, 500, byPI.Amount)
	require.Equal(t, pi.LatestCharge.ID, byPI.Charge.ID)
	require.Equal(t, 3, s.Refunds())
}

// ---- raw backend calls -----------------------------------------------------------

func TestBackendCallRaw(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	b := s.Backends(nil).API

	call := func(body string) (*stripe.Charge, error) {
		ch := &stripe.Charge{}
		err := b.CallRaw(http.MethodPost, "/v1/charges", stripetest.TestKey, []byte(body),
			&stripe.Params{IdempotencyKey: stripe.String("raw-1"), Context: context.Background()}, ch)
		return ch, err
	}
	first, err := call("amount=250&currency=usd&customer=cus_123&metadata[outbox_id]=7")
	require.NoError(t, err)
	require.EqualValues(t, 250, first.Amount)
	require.Equal(t, "cus_123", first.Customer.ID)
	require.Equal(t, "7", first.Metadata["outbox_id"])

	second, err := call("metadata[outbox_id]=7&customer=cus_123&currency=usd&amount=250")
	require.NoError(t, err)
	require.Equal(t, first.ID, second.ID)
	require.Equal(t, "true", second.LastResponse.Header.Get("Idempotent-Replayed"))

	_, err = call("amount=251&currency=usd&customer=cus_123")
	require.Equal(t, stripe.ErrorTypeIdempotency, stripeErr(t, err).Type)
	require.Equal(t, 1, s.ChargesFor("raw-1"))
}

func TestUnknownRoute(t *testing.T) {
	t.Parallel()
	s := newServer(t, stripetest.Options{})
	res := rawPost(t, s, "/v1/customers", stripetest.TestKey, "", "email=a@b.c", nil)
	require.Equal(t, http.StatusNotFound, res.status)
	require.Equal(t, "invalid_request_error", res.errField("type"))
}
