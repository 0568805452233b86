// Package stripe is a minimal stub of github.com/stripe/stripe-go/v82 with
// only the shapes the idemkey analyzer looks at.
package stripe

import "context"

// Params mirrors stripe.Params: every XxxParams embeds it.
type Params struct {
	Context        context.Context
	IdempotencyKey *string
	Metadata       map[string]string
}

func (p *Params) SetIdempotencyKey(val string) { p.IdempotencyKey = &val }

func (p *Params) AddMetadata(key, value string) {}

// ListParams has no idempotency key: lists are reads.
type ListParams struct {
	Limit *int64
}

func String(v string) *string { return &v }

func Int64(v int64) *int64 { return &v }

type Charge struct{ ID string }

type Customer struct{ ID string }

type APIResponse struct{}

type ChargeParams struct {
	Params   `form:"*"`
	Amount   *int64
	Currency *string
}

type ChargeCaptureParams struct {
	Params `form:"*"`
}

type ChargeListParams struct {
	ListParams `form:"*"`
}

type ChargeCreateParams struct {
	Params `form:"*"`
	Amount *int64
}

type ChargeRetrieveParams struct {
	Params `form:"*"`
}

type CustomerParams struct {
	Params `form:"*"`
	Email  *string
}

type RawParams struct {
	Params `form:"*"`
}

// Client mirrors the v82 stripe.Client with its V1Xxx services.
type Client struct {
	V1Charges *v1ChargeService
}

func NewClient(key string) *Client { return &Client{V1Charges: &v1ChargeService{}} }

type v1ChargeService struct{}

func (c v1ChargeService) Create(ctx context.Context, params *ChargeCreateParams) (*Charge, error) {
	return &Charge{}, nil
}

func (c v1ChargeService) Retrieve(ctx context.Context, id string, params *ChargeRetrieveParams) (*Charge, error) {
	return &Charge{}, nil
}

func RawRequest(method, path string, content string, params *RawParams) (*APIResponse, error) {
	return &APIResponse{}, nil
}
