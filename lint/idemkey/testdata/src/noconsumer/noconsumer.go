// Package noconsumer has no Watermill handlers, so nothing is reported,
// except an opt-out comment without a reason.
package noconsumer

import "net/http"

func Post() error {
	_, err := http.Post("https://example.com", "text/plain", nil)
	return err
}

func Annotated() error {
	_, err := http.Post("https://example.com", "text/plain", nil) //txbox:nolint-idempotency-but-not-really
	return err
}

/* want `needs a reason` */ //txbox:nolint-idempotency
