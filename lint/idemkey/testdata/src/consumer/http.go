// Package consumer holds Watermill handlers that call HTTP APIs, with the
// diagnostics idemkey must (and must not) produce.
package consumer

import (
	"context"
	"net/http"
	"net/url"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
)

const api = "https://api.example.com/orders"

// A NoPublishHandlerFunc-shaped function is a handler.
func handleOrderPlaced(msg *message.Message) error {
	_, err := http.Post(api, "application/json", strings.NewReader(string(msg.Payload))) // want `^http\.Post in a Watermill handler sends a non-idempotent request without an Idempotency-Key; enqueue it with outbox\.Call so the relay sends it with a stable key, or set the header$`
	return err
}

type Consumer struct {
	client *http.Client
	doer   Doer
}

// Doer is the usual seam for faking the HTTP client in tests.
type Doer interface {
	Do(*http.Request) (*http.Response, error)
}

// A HandlerFunc-shaped method is a handler.
func (c *Consumer) Handle(msg *message.Message) ([]*message.Message, error) {
	_, err := c.client.PostForm(api, url.Values{"id": {msg.UUID}}) // want `^\(\*http\.Client\)\.PostForm in a Watermill handler`
	return nil, err
}

func (c *Consumer) HandlePut(msg *message.Message) error {
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPut, api, nil)
	if err != nil {
		return err
	}
	_, err = c.client.Do(req) // want `^\(\*http\.Client\)\.Do of a PUT request in a Watermill handler`
	return err
}

func (c *Consumer) HandleDelete(msg *message.Message) error {
	req, _ := http.NewRequest("DELETE", api+"/"+msg.UUID, nil)
	_, err := http.DefaultClient.Do(req) // want `^\(\*http\.Client\)\.Do of a DELETE request`
	return err
}

// Requests reach the client through an interface just the same.
func (c *Consumer) HandlePatchViaDoer(msg *message.Message) error {
	req, _ := http.NewRequest(http.MethodPatch, api, nil)
	req.Header.Set("Content-Type", "application/json")
	_, err := c.doer.Do(req.WithContext(context.Background())) // want `^c\.doer\.Do of a PATCH request`
	return err
}

// A request built as a literal, or whose method is set afterwards.
func (c *Consumer) HandleLiteral(msg *message.Message) error {
	u, _ := url.Parse(api)
	req := &http.Request{Method: "POST", URL: u, Header: http.Header{"Content-Type": {"application/json"}}}
	if _, err := c.client.Do(req); err != nil { // want `^\(\*http\.Client\)\.Do of a POST request`
		return err
	}
	req2, _ := http.NewRequest(http.MethodGet, api, nil)
	req2.Method = http.MethodPost
	_, err := http.DefaultTransport.RoundTrip(req2) // want `^\(http\.RoundTripper\)\.RoundTrip of a POST request`
	return err
}

// Closures registered with the Router are handlers too.
func Register(r *message.Router, c *Consumer) {
	r.AddNoPublisherHandler("notify", "orders", nil, func(msg *message.Message) error {
		_, err := c.client.Post(api, "text/plain", nil) // want `^\(\*http\.Client\)\.Post in a Watermill handler`
		return err
	})
	r.AddHandler("audit", "orders", nil, "audit", nil, message.HandlerFunc(c.Handle))
	r.AddConsumerHandler("ship", "orders", nil, c.ship)
}

// Code called from a handler, transitively, is consumer code.
func (c *Consumer) ship(msg *message.Message) error {
	return c.notifyCarrier(msg.UUID)
}

func (c *Consumer) notifyCarrier(id string) error {
	return postEvent(id)
}

func postEvent(id string) error {
	_, err := http.Post(api+"/events", "text/plain", strings.NewReader(id)) // want `^http\.Post in postEvent \(called from Watermill handler \(\*Consumer\)\.ship\) sends`
	return err
}

// A request sent by a same-package helper is reported where it is built,
// since only there is its method known.
func (c *Consumer) HandleViaHelper(msg *message.Message) error {
	req, _ := http.NewRequest(http.MethodPost, api, nil)
	return c.send(req) // want `^c\.send \(passing a POST request to \(\*http\.Client\)\.Do\) in a Watermill handler`
}

func (c *Consumer) send(req *http.Request) error {
	return c.sendNow(req)
}

func (c *Consumer) sendNow(req *http.Request) error {
	_, err := c.client.Do(req)
	return err
}

// Middleware closures wrap every handler and run per delivery as well.
func Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		_, _ = http.Post(api+"/seen", "text/plain", nil) // want `^http\.Post in a Watermill handler`
		return h(msg)
	}
}

// A package-level handler literal.
var handleRefund = func(msg *message.Message) error {
	_, err := http.PostForm(api, nil) // want `^http\.PostForm in a Watermill handler`
	return err
}

// An empty key is no key.
func (c *Consumer) HandleEmptyKey(msg *message.Message) error {
	req, _ := http.NewRequest(http.MethodPost, api, nil)
	req.Header.Set("Idempotency-Key", "")
	_, err := c.client.Do(req) // want `^\(\*http\.Client\)\.Do of a POST request`
	return err
}
