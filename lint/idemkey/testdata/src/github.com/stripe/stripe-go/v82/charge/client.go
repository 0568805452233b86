// Package charge is a minimal stub of github.com/stripe/stripe-go/v82/charge.
package charge

import stripe "github.com/stripe/stripe-go/v82"

func New(params *stripe.ChargeParams) (*stripe.Charge, error) { return &stripe.Charge{}, nil }

func Get(id string, params *stripe.ChargeParams) (*stripe.Charge, error) {
	return &stripe.Charge{}, nil
}

func Update(id string, params *stripe.ChargeParams) (*stripe.Charge, error) {
	return &stripe.Charge{}, nil
}

func Capture(id string, params *stripe.ChargeCaptureParams) (*stripe.Charge, error) {
	return &stripe.Charge{}, nil
}

type Iter struct{}

func List(params *stripe.ChargeListParams) *Iter { return &Iter{} }

// Client mirrors the deprecated per-resource clients.
type Client struct {
	Key string
}

func (c Client) New(params *stripe.ChargeParams) (*stripe.Charge, error) {
	return &stripe.Charge{}, nil
}
