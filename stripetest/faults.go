package stripetest

import (
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// FaultKind selects what an injected [Fault] does to a request.
type FaultKind int

const (
	// FaultDropAfterCharge lets the request execute normally (the charge is
	// created and, for a request with an idempotency key, the response is
	// stored), then hijacks and closes the connection without writing any
	// response. The client sees a connection error (EOF) and cannot know
	// whether it was charged; a retry with the same key gets the stored
	// response. Applied to a request that does not execute (a replay, a
	// validation error, ...) it drops that response instead.
	//
	// net/http's Transport silently re-sends a request that has an
	// Idempotency-Key header when a reused keep-alive connection fails
	// before the response, which hides this fault from a plain client (the
	// relay's sends each request once); disable keep-alives on such a client
	// to observe it.
	FaultDropAfterCharge FaultKind = iota + 1

	// FaultSlow holds the response: the request executes immediately (the
	// charge is created and counted), then the double waits for Delay, or
	// until Release is closed, or until the server closes, whichever comes
	// first, before storing the response for the key and writing it. During
	// the wait the key is in flight: another request with the same key gets
	// 409 idempotency_key_in_use (see [Server.InFlight]). The wait is not cut
	// short when the client times out or goes away.
	FaultSlow

	// Fault500 is a transient infrastructure failure: the double responds
	// 500 with error type "api_error" and header "Stripe-Should-Retry: true"
	// before the endpoint executes. Nothing is charged and nothing is stored
	// for the key, so a retry with the same key executes normally.
	Fault500

	// Fault500Stored is a failure of the endpoint after it started
	// executing: the double responds 500 with error type "api_error" and
	// header "Stripe-Should-Retry: false", nothing is charged, and (Stripe's
	// semantics) the 500 is stored as the key's response, so every retry
	// with the same key gets the same 500 replayed with
	// "Idempotent-Replayed: true" until the key is forgotten. It has no
	// effect on requests that do not execute (replays, 409, validation
	// errors) nor on GET requests.
	Fault500Stored

	// Fault429 responds 429 with error type "invalid_request_error", code
	// "rate_limit" and a "Retry-After" header of RetryAfter rounded up to
	// whole seconds (default 1). Nothing is charged, nothing is stored.
	Fault429

	// Fault503 responds 503 with error type "api_error" and header
	// "Stripe-Should-Retry: true". Nothing is charged, nothing is stored.
	// Note that stripe-go does not retry it (it only retries Stripe errors
	// that are 429 lock_timeout), so the caller must.
	Fault503
)

func (k FaultKind) String() string {
	switch k {
	case FaultDropAfterCharge:
		return "FaultDropAfterCharge"
	case FaultSlow:
		return "FaultSlow"
	case Fault500:
		return "Fault500"
	case Fault500Stored:
		return "Fault500Stored"
	case Fault429:
		return "Fault429"
	case Fault503:
		return "Fault503"
	}
	return "FaultKind(" + strconv.Itoa(int(k)) + ")"
}

// Fault describes a fault to inject with [Server.Inject].
//
// Faults are matched against requests after authentication and Idempotency-Key
// length validation, in the order they were injected; the first matching
// fault with uses left applies and uses one of its Count.
type Fault struct {
	// Kind is what happens to the matched request. Required.
	Kind FaultKind
	// Key restricts the fault to requests with this Idempotency-Key.
	// Empty matches any request, with or without a key.
	Key string
	// Path restricts the fault to requests for this URL path, e.g.
	// "/v1/refunds". Empty matches any path.
	Path string
	// Count is how many matching requests the fault applies to. 0 means 1;
	// negative means every matching request until [Server.ClearFaults].
	Count int
	// Delay is how long FaultSlow holds the response.
	Delay time.Duration
	// Release, if not nil, ends a FaultSlow wait when closed (even if Delay
	// is 0). Useful to hold a request in flight deterministically.
	Release <-chan struct{}
	// RetryAfter is the Retry-After of Fault429 (rounded up to whole
	// seconds, default 1s).
	RetryAfter time.Duration
}

type pendingFault struct {
	f         Fault
	remaining int // < 0: unlimited
}

// Inject registers a fault. It panics on an unknown Kind and on a FaultSlow
// with neither Delay nor Release.
func (s *Server) Inject(f Fault) {
	if f.Kind < FaultDropAfterCharge || f.Kind > Fault503 {
		panic(fmt.Sprintf("stripetest: Inject: unknown fault kind %d", int(f.Kind)))
	}
	if f.Kind == FaultSlow && f.Delay <= 0 && f.Release == nil {
		panic("stripetest: Inject: FaultSlow needs a Delay or a Release channel")
	}
	n := f.Count
	if n == 0 {
		n = 1
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = append(s.faults, &pendingFault{f: f, remaining: n})
}

// ClearFaults removes all injected faults that have uses left.
func (s *Server) ClearFaults() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = nil
}

// PendingFaults is the number of injected faults that have uses left.
func (s *Server) PendingFaults() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.faults)
}

// takeFault finds the first fault matching the request and uses it once.
func (s *Server) takeFault(key, path string) (Fault, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, pf := range s.faults {
		if pf.f.Key != "" && pf.f.Key != key {
			continue
		}
		if pf.f.Path != "" && pf.f.Path != path {
			continue
		}
		if pf.remaining > 0 {
			pf.remaining--
			if pf.remaining == 0 {
				s.faults = append(s.faults[:i:i], s.faults[i+1:]...)
			}
		}
		return pf.f, true
	}
	return Fault{}, false
}

func rateLimitResponse(retryAfter time.Duration) response {
	secs := int64((retryAfter + time.Second - 1) / time.Second)
	if secs < 1 {
		secs = 1
	}
	res := errorResponse(http.StatusTooManyRequests, apiError{
		Type:    "invalid_request_error",
		Code:    "rate_limit",
		Message: "Too many requests hit the API too quickly. We recommend an exponential backoff of your requests.",
	})
	res.header = http.Header{"Retry-After": {strconv.FormatInt(secs, 10)}}
	return res
}

func unavailableResponse() response {
	res := errorResponse(http.StatusServiceUnavailable, apiError{
		Type:    "api_error",
		Message: "The Stripe API is temporarily unavailable. Please retry the request.",
	})
	res.header = http.Header{"Stripe-Should-Retry": {"true"}}
	return res
}

func serverErrorResponse(shouldRetry bool) response {
	res := errorResponse(http.StatusInternalServerError, apiError{
		Type:    "api_error",
		Message: "An unknown error occurred while processing the request.",
	})
	res.header = http.Header{"Stripe-Should-Retry": {strconv.FormatBool(shouldRetry)}}
	return res
}
