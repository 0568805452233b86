package consumer

import (
	"context"
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
	stripe "github.com/stripe/stripe-go/v82"
	"github.com/stripe/stripe-go/v82/charge"
	"github.com/stripe/stripe-go/v82/customer"
)

type Billing struct {
	sc *stripe.Client
}

func (b *Billing) HandleCharge(msg *message.Message) error {
	params := &stripe.ChargeParams{Amount: stripe.Int64(100), Currency: stripe.String("eur")}
	_, err := charge.New(params) // want `^stripe call charge\.New in a Watermill handler sends a non-idempotent request without an Idempotency-Key; enqueue it with outbox\.Call so the relay sends it with a stable key, or set one with params\.SetIdempotencyKey$`
	return err
}

func (b *Billing) HandleClient(msg *message.Message) error {
	_, err := b.sc.V1Charges.Create(context.Background(), &stripe.ChargeCreateParams{Amount: stripe.Int64(1)}) // want `^stripe call b\.sc\.V1Charges\.Create in a Watermill handler`
	if err != nil {
		return err
	}
	var capture stripe.ChargeCaptureParams
	_, err = charge.Capture(msg.UUID, &capture) // want `^stripe call charge\.Capture in`
	if err != nil {
		return err
	}
	_, err = customer.Del(msg.UUID, nil) // want `^stripe call customer\.Del in`
	if err != nil {
		return err
	}
	_, err = stripe.RawRequest(http.MethodPost, "/v1/things", "", &stripe.RawParams{}) // want `^stripe call stripe\.RawRequest in`
	if err != nil {
		return err
	}
	_, err = charge.Client{}.New(new(stripe.ChargeParams)) // want `^stripe call charge\.Client\{\}\.New in`
	return err
}

// Params built in the handler and sent by a helper.
func (b *Billing) HandleViaHelper(msg *message.Message) error {
	return createCustomer(&stripe.CustomerParams{Email: stripe.String("a@b.c")}) // want `^createCustomer \(passing its params to stripe call customer\.New\) in a Watermill handler`
}

func createCustomer(p *stripe.CustomerParams) error {
	p.AddMetadata("source", "consumer")
	_, err := customer.New(p)
	return err
}

// Keys set in every way the analyzer understands, and reads.
func (b *Billing) HandleKeyed(msg *message.Message) error {
	set := &stripe.ChargeParams{Amount: stripe.Int64(100)}
	set.SetIdempotencyKey("charge-" + msg.UUID)
	if _, err := charge.New(set); err != nil {
		return err
	}
	field := &stripe.ChargeParams{}
	field.IdempotencyKey = stripe.String(msg.UUID)
	if _, err := charge.Update(msg.UUID, field); err != nil {
		return err
	}
	inLiteral := &stripe.ChargeCreateParams{Params: stripe.Params{IdempotencyKey: stripe.String(msg.UUID)}}
	if _, err := b.sc.V1Charges.Create(context.Background(), inLiteral); err != nil {
		return err
	}
	var byValue stripe.ChargeCaptureParams
	byValue.Params.SetIdempotencyKey(msg.UUID)
	if _, err := charge.Capture(msg.UUID, &byValue); err != nil {
		return err
	}
	if _, err := customer.New(keyed(msg.UUID)); err != nil { // built elsewhere: unknown
		return err
	}
	_, _ = stripe.RawRequest(http.MethodGet, "/v1/things", "", nil)
	_, _ = charge.Get(msg.UUID, &stripe.ChargeParams{})
	_ = charge.List(&stripe.ChargeListParams{})
	_, err := b.sc.V1Charges.Retrieve(context.Background(), msg.UUID, nil)
	return err
}

func keyed(key string) *stripe.CustomerParams {
	p := &stripe.CustomerParams{}
	p.SetIdempotencyKey(key)
	return p
}
