// Package idemkey defines an Analyzer that reports side-effecting HTTP
// calls made from Watermill consumer code without an idempotency key.
//
// # Why
//
// Watermill delivers messages at least once: a handler that fails, times
// out or crashes after its side effect but before the ack sees the same
// message again. A handler that POSTs to a payment provider or a partner
// API without an Idempotency-Key then charges, ships or notifies twice.
// The fix txbox offers is to enqueue the call with outbox.Call inside the
// handler's transaction, so the relay sends it with a key that stays the
// same across redeliveries; the other fix is to set the header yourself
// from something stable, such as the message UUID.
//
// # What it finds
//
// Consumer code is:
//
//   - every function, method and func literal shaped like
//     message.HandlerFunc, func(*message.Message) ([]*message.Message, error),
//     or message.NoPublishHandlerFunc, func(*message.Message) error, from
//     github.com/ThreeDotsLabs/watermill/message, which includes handlers
//     passed to (*message.Router).AddHandler, AddNoPublisherHandler and
//     AddConsumerHandler and the closures returned by middleware;
//   - every function and method of the same package that such code uses,
//     transitively, when the target is static: calls, but also method
//     values and function values passed along (to a retry helper, say).
//
// In consumer code it reports:
//
//   - http.Post, http.PostForm, (*http.Client).Post and (*http.Client).PostForm,
//     which cannot carry a header at all;
//   - (*http.Client).Do (http.DefaultClient.Do included), RoundTrip on an
//     http.RoundTripper or *http.Transport, and Do on any type with the
//     shape Do(*http.Request) (*http.Response, error) (the interface
//     consumers use to fake the client), when the request was built in the
//     same function by http.NewRequest, http.NewRequestWithContext or an
//     http.Request literal with a constant method of POST, PUT, PATCH or
//     DELETE, and no Idempotency-Key header is set on it in that function,
//     by req.Header.Set, req.Header.Add, req.Header["Idempotency-Key"] = …
//     or a Header literal (the name is compared case-insensitively; a
//     Set or Add of a constant blank value sets none);
//   - mutating stripe-go calls (any major version; functions such as
//     charge.New and methods such as sc.V1Charges.Create whose name starts
//     with a write verb: New, Create, Update, Cancel, Capture, Confirm, Del,
//     Delete, Refund, Void, Finalize, Pay… but not CreatePreview; RawRequest
//     with a constant write method) whose params argument was built in the
//     same function (a literal, new, a zero value or nil) and never had a
//     key set there, by params.SetIdempotencyKey, params.IdempotencyKey = …
//     or IdempotencyKey in the literal's Params. Get, List, Retrieve,
//     Search and other reads are not reported.
//
// "The same function" is a function declaration including all closures in
// it, so a header set before retry(func() error { … client.Do(req) … }) is
// seen. Request and params values are followed through plain assignment,
// &x and *x, req.WithContext, req.Clone, req.Header and params.Params.
//
// Small same-package helpers are understood in both directions. A helper
// that sets the key on its *http.Request, http.Header or params argument
// counts as setting it at the call site, and a helper that sends its
// argument without setting the key (func (c *C) send(req *http.Request))
// makes its call site a send, reported there, where the method is known:
//
//	c.send (passing a POST request to (*http.Client).Do) in a Watermill handler sends …
//
// # Opting out
//
// A comment
//
//	//txbox:nolint-idempotency <reason>
//
// on the line of the reported call, or alone on the line above it,
// suppresses the report, e.g. for an endpoint that deduplicates on its
// own. The reason is mandatory: the comment without one is reported.
//
// # Limits
//
// The analyzer is deliberately quiet when it cannot prove a problem, so it
// misses some and should not be taken as a guarantee:
//
//   - Packages are analysed one at a time: a handler calling a function in
//     another package (an API client package, say) is not followed into it.
//     Handlers themselves are found by their shape in the package that
//     declares them, wherever they are registered.
//   - Dynamic dispatch is not followed: calls through interfaces (other than
//     the Do shape above) and through func-typed variables and fields do not
//     extend consumer code.
//   - A request whose method is not a constant, or that comes from a call,
//     a struct field, a channel or a range variable, is not reported.
//     Likewise stripe params that come from a builder function or a field.
//   - A key set anywhere but in the function itself or in a same-package
//     helper that receives the request, its Header or the params as an
//     argument is not seen: by a function of another package, through a
//     struct field, or by a RoundTripper or client middleware that adds
//     the header to every request. Such calls are reported and need the
//     opt-out comment. Conversely a header name that is not a constant,
//     and a Header or Params field assigned from a variable, are assumed
//     to carry the key.
//   - It is flow-insensitive: a key set anywhere in the function counts, even
//     after the call or on another branch, and a variable that holds
//     several requests is reported if any of them is a write.
//   - Other HTTP clients (resty, go-retryablehttp, generated OpenAPI
//     clients) and other SDKs are not recognised.
//   - Test files are analysed like any other when the driver includes them
//     (txbox-lint -test=false skips them).
//
// # Running it
//
// The cmd/txbox-lint command runs the analyzer alone, as a Go tool of the application's module:
//
//	go get -tool github.com/txbox/txbox/cmd/txbox-lint
//	go tool txbox-lint ./...
//	go vet -vettool="$(go tool -n txbox-lint)" ./...
//
// Other drivers (multichecker, golangci-lint's module plugins, gopls) can
// use Analyzer directly.
package idemkey
