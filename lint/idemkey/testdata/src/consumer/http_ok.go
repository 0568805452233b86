package consumer

import (
	"context"
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Requests that set the key, in every way the analyzer understands.
func (c *Consumer) HandleKeyed(msg *message.Message) error {
	req, _ := http.NewRequest(http.MethodPost, api, nil)
	req.Header.Set("Idempotency-Key", msg.UUID)
	if _, err := c.client.Do(req); err != nil {
		return err
	}

	lower, _ := http.NewRequest(http.MethodPost, api, nil)
	lower.Header.Add("idempotency-key", msg.UUID) // the name is case-insensitive
	if _, err := c.client.Do(lower); err != nil {
		return err
	}

	indexed, _ := http.NewRequestWithContext(context.Background(), "PUT", api, nil)
	indexed.Header["Idempotency-Key"] = []string{msg.UUID}
	if _, err := c.client.Do(indexed); err != nil {
		return err
	}

	aliased, _ := http.NewRequest("PATCH", api, nil)
	h := aliased.Header
	h.Set(idempotencyKeyHeader, msg.UUID)
	if _, err := c.client.Do(aliased); err != nil {
		return err
	}

	lit := &http.Request{Method: http.MethodDelete, Header: http.Header{"Idempotency-Key": {msg.UUID}}}
	if _, err := c.client.Do(lit); err != nil {
		return err
	}

	// The header is set by a same-package helper.
	helped, _ := http.NewRequest(http.MethodPost, api, nil)
	withKey(helped, msg.UUID)
	if _, err := c.client.Do(helped); err != nil {
		return err
	}
	headerHelped, _ := http.NewRequest(http.MethodPost, api, nil)
	setKey(headerHelped.Header, msg.UUID)
	if _, err := c.client.Do(headerHelped); err != nil {
		return err
	}

	// The key is set in the enclosing function, the send in a closure.
	retried, _ := http.NewRequest(http.MethodPost, api, nil)
	retried.Header.Set("Idempotency-Key", msg.UUID)
	return retry(func() error {
		_, err := c.client.Do(retried.WithContext(context.Background()))
		return err
	})
}

const idempotencyKeyHeader = "Idempotency-Key"

func withKey(r *http.Request, key string) { setKey(r.Header, key) }

func setKey(h http.Header, key string) { h.Set("Idempotency-Key", key) }

func retry(f func() error) error { return f() }

// Requests that are safe, or whose method cannot be known, are not reported.
func (c *Consumer) HandleReads(msg *message.Message) error {
	if _, err := http.Get(api); err != nil {
		return err
	}
	get, _ := http.NewRequest(http.MethodGet, api, nil)
	if _, err := c.client.Do(get); err != nil {
		return err
	}
	method := string(msg.Payload) // not a constant: unknown, so not reported
	dyn, _ := http.NewRequest(method, api, nil)
	if _, err := c.client.Do(dyn); err != nil {
		return err
	}
	built := buildRequest() // built elsewhere: unknown
	if _, err := c.client.Do(built); err != nil {
		return err
	}
	// A header name that is not a constant might be the key.
	copied, _ := http.NewRequest(http.MethodPost, api, nil)
	for k, v := range map[string]string{"Idempotency-Key": msg.UUID} {
		copied.Header.Set(k, v)
	}
	_, err := c.client.Do(copied)
	return err
}

func buildRequest() *http.Request {
	req, _ := http.NewRequest(http.MethodPost, api, nil)
	return req
}

// Not a handler and not called from one: outside consumer code.
func Backfill() error {
	_, err := http.Post(api, "text/plain", nil)
	return err
}

// Limit: calls through a func value or an interface are not followed.
type Notifier interface{ Notify(id string) error }

type httpNotifier struct{}

func (httpNotifier) Notify(id string) error {
	_, err := http.Post(api, "text/plain", nil)
	return err
}

func handleWithNotifier(n Notifier) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error { return n.Notify(msg.UUID) }
}
