// Package customer is a minimal stub of github.com/stripe/stripe-go/v82/customer.
package customer

import stripe "github.com/stripe/stripe-go/v82"

func New(params *stripe.CustomerParams) (*stripe.Customer, error) {
	return &stripe.Customer{}, nil
}

func Del(id string, params *stripe.CustomerParams) (*stripe.Customer, error) {
	return &stripe.Customer{}, nil
}
