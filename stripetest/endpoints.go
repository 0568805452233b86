package stripetest

import (
	"encoding/json"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
)

// apiError is the "error" object of a Stripe error response.
type apiError struct {
	Type          string            `json:"type"`
	Code          string            `json:"code,omitempty"`
	DeclineCode   string            `json:"decline_code,omitempty"`
	Message       string            `json:"message"`
	Param         string            `json:"param,omitempty"`
	Charge        string            `json:"charge,omitempty"`
	PaymentIntent *paymentIntentObj `json:"payment_intent,omitempty"`
	DocURL        string            `json:"doc_url,omitempty"`
}

func errorResponse(status int, e apiError) response {
	if e.Code != "" && e.DocURL == "" {
		e.DocURL = "https://stripe.com/docs/error-codes/" + strings.ReplaceAll(e.Code, "_", "-")
	}
	return jsonResponse(status, map[string]any{"error": e})
}

func jsonResponse(status int, v any) response {
	body, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		panic("stripetest: marshal response: " + err.Error())
	}
	return response{status: status, body: append(body, '\n')}
}

func missingParam(name string) response {
	return errorResponse(http.StatusBadRequest, apiError{
		Type:    "invalid_request_error",
		Code:    "parameter_missing",
		Param:   name,
		Message: "Missing required param: " + name + ".",
	})
}

func invalidParam(name, code, msg string) response {
	return errorResponse(http.StatusBadRequest, apiError{
		Type:    "invalid_request_error",
		Code:    code,
		Param:   name,
		Message: msg,
	})
}

func noSuch(kind, param, id string) response {
	return errorResponse(http.StatusNotFound, apiError{
		Type:    "invalid_request_error",
		Code:    "resource_missing",
		Param:   param,
		Message: "No such " + kind + ": '" + id + "'",
	})
}

// fingerprint identifies "the same request" for idempotency: method, path,
// Stripe-Account header and the form parameters, independent of order.
func fingerprint(r *http.Request) string {
	norm := url.Values{}
	for k, vs := range r.Form {
		vs = slices.Clone(vs)
		slices.Sort(vs)
		norm[k] = vs
	}
	return r.Method + " " + r.URL.Path + "\n" +
		strings.TrimSpace(r.Header.Get("Stripe-Account")) + "\n" + norm.Encode()
}

// routeDef is one resource of the API. For a GET, get renders the response.
// For a POST, post validates the parameters (under the server lock, without
// side effects): ok false means errRes is the response and the endpoint did
// not start executing; otherwise run executes it (creating objects, counting
// them for the idempotency key) and returns the response to store.
type routeDef struct {
	get  func(s *Server) response
	post func(s *Server, form url.Values) (run func(key string) response, errRes response, ok bool)
}

func route(method, path string) *routeDef {
	parts := strings.Split(strings.Trim(path, "/"), "/")
	if len(parts) < 2 || len(parts) > 3 || parts[0] != "v1" {
		return nil
	}
	switch {
	case method == http.MethodPost && len(parts) == 2:
		switch parts[1] {
		case "charges":
			return &routeDef{post: (*Server).postCharge}
		case "payment_intents":
			return &routeDef{post: (*Server).postPaymentIntent}
		case "refunds":
			return &routeDef{post: (*Server).postRefund}
		}
	case method == http.MethodGet && len(parts) == 3 && parts[2] != "":
		id := parts[2]
		switch parts[1] {
		case "charges":
			return &routeDef{get: func(s *Server) response {
				if c, ok := s.charges[id]; ok {
					return jsonResponse(http.StatusOK, c)
				}
				return noSuch("charge", "id", id)
			}}
		case "payment_intents":
			return &routeDef{get: func(s *Server) response {
				if pi, ok := s.intents[id]; ok {
					return jsonResponse(http.StatusOK, pi)
				}
				return noSuch("payment_intent", "intent", id)
			}}
		case "refunds":
			return &routeDef{get: func(s *Server) response {
				if rf, ok := s.refunds[id]; ok {
					return jsonResponse(http.StatusOK, rf)
				}
				return noSuch("refund", "id", id)
			}}
		}
	}
	return nil
}

// ---- parameters -----------------------------------------------------------

func formString(form url.Values, name string) (string, bool) {
	vs, ok := form[name]
	if !ok || len(vs) == 0 || vs[0] == "" {
		return "", false
	}
	return vs[0], true
}

func optString(form url.Values, name string) *string {
	if v, ok := formString(form, name); ok {
		return &v
	}
	return nil
}

func parseAmount(form url.Values, name string, required bool) (amount int64, set bool, errRes response, ok bool) {
	v, present := formString(form, name)
	if !present {
		if required {
			return 0, false, missingParam(name), false
		}
		return 0, false, response{}, true
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, false, invalidParam(name, "parameter_invalid_integer", "Invalid integer: "+v), false
	}
	if n < 1 {
		return 0, false, invalidParam(name, "parameter_invalid_integer",
			"This value must be greater than or equal to 1."), false
	}
	return n, true, response{}, true
}

func parseCurrency(form url.Values) (string, response, bool) {
	v, present := formString(form, "currency")
	if !present {
		return "", missingParam("currency"), false
	}
	c := strings.ToLower(v)
	if len(c) != 3 || strings.Trim(c, "abcdefghijklmnopqrstuvwxyz") != "" {
		return "", invalidParam("currency", "parameter_invalid_string",
			"Invalid currency: "+v+". Stripe currently supports these currencies: usd, eur, gbp, ..."), false
	}
	return c, response{}, true
}

func parseBool(form url.Values, name string, def bool) (bool, response, bool) {
	v, present := formString(form, name)
	if !present {
		return def, response{}, true
	}
	switch v {
	case "true":
		return true, response{}, true
	case "false":
		return false, response{}, true
	}
	return false, invalidParam(name, "parameter_invalid_boolean",
		"Invalid boolean: "+v), false
}

// parseMetadata collects metadata[k]=v parameters. Empty values (Stripe's
// way of unsetting a key) are dropped.
func parseMetadata(form url.Values) map[string]string {
	md := map[string]string{}
	for k, vs := range form {
		inner, ok := strings.CutPrefix(k, "metadata[")
		if !ok || !strings.HasSuffix(inner, "]") || len(vs) == 0 || vs[0] == "" {
			continue
		}
		md[strings.TrimSuffix(inner, "]")] = vs[0]
	}
	return md
}

// ---- test cards -----------------------------------------------------------

type decline struct {
	code, declineCode, message, last4 string
}

// declines maps the suffix of Stripe's declining test tokens
// ("tok_chargeDeclined...") and test payment methods
// ("pm_card_chargeDeclined...") to the resulting error.
var declineTable = map[string]decline{
	"chargeDeclined": {"card_declined", "generic_decline",
		"Your card was declined.", "0002"},
	"chargeDeclinedInsufficientFunds": {"card_declined", "insufficient_funds",
		"Your card has insufficient funds.", "9995"},
	"chargeDeclinedFraudulent": {"card_declined", "fraudulent",
		"Your card was declined.", "0019"},
	"chargeDeclinedExpiredCard": {"expired_card", "expired_card",
		"Your card has expired.", "0069"},
	"chargeDeclinedIncorrectCvc": {"incorrect_cvc", "incorrect_cvc",
		"Your card's security code is incorrect.", "0127"},
	"chargeDeclinedProcessingError": {"processing_error", "processing_error",
		"An error occurred while processing your card. Try again in a little bit.", "0119"},
}

func declineFor(paymentSource string) (decline, bool) {
	for _, prefix := range []string{"tok_", "pm_card_"} {
		if rest, ok := strings.CutPrefix(paymentSource, prefix); ok {
			d, found := declineTable[rest]
			return d, found
		}
	}
	return decline{}, false
}

func cardFor(paymentSource string) *cardObj {
	brand, last4 := "Visa", "4242"
	name := paymentSource
	for _, prefix := range []string{"tok_", "pm_card_"} {
		name = strings.TrimPrefix(name, prefix)
	}
	switch strings.ToLower(name) {
	case "mastercard":
		brand, last4 = "MasterCard", "4444"
	case "amex":
		brand, last4 = "American Express", "8431"
	}
	if d, ok := declineFor(paymentSource); ok {
		last4 = d.last4
	}
	id := paymentSource
	if !strings.HasPrefix(id, "card_") {
		id = newID("card_", 24)
	}
	return &cardObj{
		ID: id, Object: "card", Brand: brand, Last4: last4,
		ExpMonth: 12, ExpYear: 2034, Funding: "credit", Country: "US",
	}
}

// ---- objects --------------------------------------------------------------

type cardObj struct {
	ID       string `json:"id"`
	Object   string `json:"object"`
	Brand    string `json:"brand"`
	Country  string `json:"country"`
	ExpMonth int    `json:"exp_month"`
	ExpYear  int    `json:"exp_year"`
	Funding  string `json:"funding"`
	Last4    string `json:"last4"`
}

type outcomeObj struct {
	NetworkStatus string  `json:"network_status"`
	Reason        *string `json:"reason"`
	RiskLevel     string  `json:"risk_level"`
	SellerMessage string  `json:"seller_message"`
	Type          string  `json:"type"`
}

type chargeObj struct {
	ID             string            `json:"id"`
	Object         string            `json:"object"`
	Amount         int64             `json:"amount"`
	AmountCaptured int64             `json:"amount_captured"`
	AmountRefunded int64             `json:"amount_refunded"`
	Captured       bool              `json:"captured"`
	Created        int64             `json:"created"`
	Currency       string            `json:"currency"`
	Customer       *string           `json:"customer"`
	Description    *string           `json:"description"`
	FailureCode    *string           `json:"failure_code"`
	FailureMessage *string           `json:"failure_message"`
	Livemode       bool              `json:"livemode"`
	Metadata       map[string]string `json:"metadata"`
	Outcome        *outcomeObj       `json:"outcome"`
	Paid           bool              `json:"paid"`
	PaymentIntent  *string           `json:"payment_intent"`
	PaymentMethod  *string           `json:"payment_method"`
	Refunded       bool              `json:"refunded"`
	Source         *cardObj          `json:"source"`
	Status         string            `json:"status"`
}

type paymentIntentObj struct {
	ID                 string            `json:"id"`
	Object             string            `json:"object"`
	Amount             int64             `json:"amount"`
	AmountReceived     int64             `json:"amount_received"`
	CaptureMethod      string            `json:"capture_method"`
	ClientSecret       string            `json:"client_secret"`
	ConfirmationMethod string            `json:"confirmation_method"`
	Created            int64             `json:"created"`
	Currency           string            `json:"currency"`
	Customer           *string           `json:"customer"`
	Description        *string           `json:"description"`
	LastPaymentError   *apiError         `json:"last_payment_error"`
	LatestCharge       *string           `json:"latest_charge"`
	Livemode           bool              `json:"livemode"`
	Metadata           map[string]string `json:"metadata"`
	PaymentMethod      *string           `json:"payment_method"`
	PaymentMethodTypes []string          `json:"payment_method_types"`
	Status             string            `json:"status"`
}

type refundObj struct {
	ID            string            `json:"id"`
	Object        string            `json:"object"`
	Amount        int64             `json:"amount"`
	Charge        string            `json:"charge"`
	Created       int64             `json:"created"`
	Currency      string            `json:"currency"`
	Metadata      map[string]string `json:"metadata"`
	PaymentIntent *string           `json:"payment_intent"`
	Reason        *string           `json:"reason"`
	Status        string            `json:"status"`
}

func (s *Server) recordObjectLocked(key, id string) {
	s.objectsFor[key] = append(s.objectsFor[key], id)
}

// newChargeLocked creates and stores a charge; if d is not nil it is a
// failed (declined) charge.
func (s *Server) newChargeLocked(key string, amount int64, currency string, capture bool,
	customer, description, paymentSource, paymentIntent *string, md map[string]string, d *decline,
) *chargeObj {
	c := &chargeObj{
		ID:            newID("ch_", 24),
		Object:        "charge",
		Amount:        amount,
		Created:       s.now().Unix(),
		Currency:      currency,
		Customer:      customer,
		Description:   description,
		Metadata:      md,
		PaymentIntent: paymentIntent,
	}
	if paymentSource != nil {
		card := cardFor(*paymentSource)
		c.PaymentMethod = &card.ID
		if strings.HasPrefix(*paymentSource, "pm_") {
			c.PaymentMethod = paymentSource
		} else {
			c.Source = card
		}
	}
	if d != nil {
		reason := d.declineCode
		c.Status = "failed"
		c.FailureCode = &d.code
		c.FailureMessage = &d.message
		c.Outcome = &outcomeObj{
			NetworkStatus: "declined_by_network", Reason: &reason, RiskLevel: "normal",
			SellerMessage: "The bank did not return any further details with this decline.",
			Type:          "issuer_declined",
		}
		s.declines++
		s.declinesFor[key]++
	} else {
		c.Status = "succeeded"
		c.Paid = true
		c.Captured = capture
		if capture {
			c.AmountCaptured = amount
		}
		c.Outcome = &outcomeObj{
			NetworkStatus: "approved_by_network", RiskLevel: "normal",
			SellerMessage: "Payment complete.", Type: "authorized",
		}
	}
	s.charges[c.ID] = c
	s.recordObjectLocked(key, c.ID)
	return c
}

func cardError(d decline, chargeID string, pi *paymentIntentObj) apiError {
	return apiError{
		Type:          "card_error",
		Code:          d.code,
		DeclineCode:   d.declineCode,
		Message:       d.message,
		Charge:        chargeID,
		PaymentIntent: pi,
	}
}

// ---- POST /v1/charges -----------------------------------------------------

func (s *Server) postCharge(form url.Values) (func(string) response, response, bool) {
	amount, _, errRes, ok := parseAmount(form, "amount", true)
	if !ok {
		return nil, errRes, false
	}
	currency, errRes, ok := parseCurrency(form)
	if !ok {
		return nil, errRes, false
	}
	capture, errRes, ok := parseBool(form, "capture", true)
	if !ok {
		return nil, errRes, false
	}
	source, customer := optString(form, "source"), optString(form, "customer")
	if source == nil && customer == nil {
		return nil, errorResponse(http.StatusBadRequest, apiError{
			Type:    "invalid_request_error",
			Code:    "parameter_missing",
			Param:   "source",
			Message: "Must provide source or customer.",
		}), false
	}
	description := optString(form, "description")
	md := parseMetadata(form)

	return func(key string) response {
		var dp *decline
		if source != nil {
			if d, declined := declineFor(*source); declined {
				dp = &d
			}
		}
		c := s.newChargeLocked(key, amount, currency, capture, customer, description, source, nil, md, dp)
		if dp != nil {
			return errorResponse(http.StatusPaymentRequired, cardError(*dp, c.ID, nil))
		}
		s.totalCharges++
		s.chargesFor[key]++
		return jsonResponse(http.StatusOK, c)
	}, response{}, true
}

// ---- POST /v1/payment_intents ---------------------------------------------

func (s *Server) postPaymentIntent(form url.Values) (func(string) response, response, bool) {
	amount, _, errRes, ok := parseAmount(form, "amount", true)
	if !ok {
		return nil, errRes, false
	}
	currency, errRes, ok := parseCurrency(form)
	if !ok {
		return nil, errRes, false
	}
	confirm, errRes, ok := parseBool(form, "confirm", false)
	if !ok {
		return nil, errRes, false
	}
	pm := optString(form, "payment_method")
	if confirm && pm == nil {
		return nil, errorResponse(http.StatusBadRequest, apiError{
			Type:  "invalid_request_error",
			Code:  "parameter_missing",
			Param: "payment_method",
			Message: "You cannot confirm this PaymentIntent because it's missing a payment method. " +
				"To confirm the PaymentIntent, provide a payment_method.",
		}), false
	}
	customer, description := optString(form, "customer"), optString(form, "description")
	md := parseMetadata(form)

	return func(key string) response {
		id := newID("pi_", 24)
		pi := &paymentIntentObj{
			ID:                 id,
			Object:             "payment_intent",
			Amount:             amount,
			CaptureMethod:      "automatic",
			ClientSecret:       id + "_secret_" + newID("", 25),
			ConfirmationMethod: "automatic",
			Created:            s.now().Unix(),
			Currency:           currency,
			Customer:           customer,
			Description:        description,
			Metadata:           md,
			PaymentMethod:      pm,
			PaymentMethodTypes: []string{"card"},
		}
		s.intents[id] = pi
		s.recordObjectLocked(key, id)
		switch {
		case !confirm && pm == nil:
			pi.Status = "requires_payment_method"
		case !confirm:
			pi.Status = "requires_confirmation"
		default:
			if d, declined := declineFor(*pm); declined {
				c := s.newChargeLocked(key, amount, currency, true, customer, description, pm, &pi.ID, md, &d)
				pi.Status = "requires_payment_method"
				pi.LatestCharge = &c.ID
				pi.PaymentMethod = nil
				lastErr := cardError(d, c.ID, nil)
				pi.LastPaymentError = &lastErr
				snapshot := *pi
				return errorResponse(http.StatusPaymentRequired, cardError(d, c.ID, &snapshot))
			}
			c := s.newChargeLocked(key, amount, currency, true, customer, description, pm, &pi.ID, md, nil)
			pi.Status = "succeeded"
			pi.AmountReceived = amount
			pi.LatestCharge = &c.ID
		}
		s.totalCharges++
		s.chargesFor[key]++
		return jsonResponse(http.StatusOK, pi)
	}, response{}, true
}

// ---- POST /v1/refunds -----------------------------------------------------

func (s *Server) postRefund(form url.Values) (func(string) response, response, bool) {
	chargeID, piID := optString(form, "charge"), optString(form, "payment_intent")
	var c *chargeObj
	switch {
	case chargeID == nil && piID == nil:
		return nil, errorResponse(http.StatusBadRequest, apiError{
			Type:    "invalid_request_error",
			Code:    "parameter_missing",
			Param:   "charge",
			Message: "One of the following params should be provided for this request: charge or payment_intent.",
		}), false
	case chargeID != nil:
		c = s.charges[*chargeID]
		if c == nil {
			return nil, noSuch("charge", "charge", *chargeID), false
		}
	default:
		pi := s.intents[*piID]
		if pi == nil {
			return nil, noSuch("payment_intent", "payment_intent", *piID), false
		}
		if pi.Status != "succeeded" || pi.LatestCharge == nil {
			return nil, errorResponse(http.StatusBadRequest, apiError{
				Type:    "invalid_request_error",
				Code:    "payment_intent_unexpected_state",
				Param:   "payment_intent",
				Message: "This PaymentIntent (" + pi.ID + ") does not have a successful charge to refund.",
			}), false
		}
		c = s.charges[*pi.LatestCharge]
	}
	if c.Status != "succeeded" {
		return nil, invalidParam("charge", "charge_not_refundable",
			"Charge "+c.ID+" has no successful payment to refund."), false
	}
	remaining := c.Amount - c.AmountRefunded
	if remaining <= 0 {
		return nil, invalidParam("charge", "charge_already_refunded",
			"Charge "+c.ID+" has already been refunded."), false
	}
	amount, set, errRes, ok := parseAmount(form, "amount", false)
	if !ok {
		return nil, errRes, false
	}
	if !set {
		amount = remaining
	}
	if amount > remaining {
		return nil, invalidParam("amount", "amount_too_large",
			"Refund amount ("+strconv.FormatInt(amount, 10)+") is greater than unrefunded amount on charge ("+
				strconv.FormatInt(remaining, 10)+")"), false
	}
	reason := optString(form, "reason")
	md := parseMetadata(form)

	return func(key string) response {
		rf := &refundObj{
			ID:            newID("re_", 24),
			Object:        "refund",
			Amount:        amount,
			Charge:        c.ID,
			Created:       s.now().Unix(),
			Currency:      c.Currency,
			Metadata:      md,
			PaymentIntent: c.PaymentIntent,
			Reason:        reason,
			Status:        "succeeded",
		}
		c.AmountRefunded += amount
		c.Refunded = c.AmountRefunded >= c.Amount
		s.refunds[rf.ID] = rf
		s.recordObjectLocked(key, rf.ID)
		s.totalRefunds++
		s.refundsFor[key]++
		return jsonResponse(http.StatusOK, rf)
	}, response{}, true
}
