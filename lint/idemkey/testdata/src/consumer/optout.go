package consumer

import (
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
)

func handleOptOut(msg *message.Message) error {
	_, _ = http.Post(api, "text/plain", nil) //txbox:nolint-idempotency the endpoint deduplicates by message UUID

	req, _ := http.NewRequest(http.MethodPut, api, nil)
	//txbox:nolint-idempotency PUT replaces the whole resource, repeating it is harmless
	_, _ = http.DefaultClient.Do(req)

	/* want `^//txbox:nolint-idempotency needs a reason` */ //txbox:nolint-idempotency
	_, _ = http.Post(api, "text/plain", nil)

	// A directive two lines up does not count.
	//txbox:nolint-idempotency too far away

	_, err := http.Post(api, "text/plain", nil) // want `^http\.Post in a Watermill handler`
	return err
}
