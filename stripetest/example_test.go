package stripetest_test

import (
	"context"
	"fmt"
	"net/http"

	"github.com/stripe/stripe-go/v82"

	"github.com/txbox/txbox/stripetest"
)

// A charge whose response is lost on the way back is retried with the same Idempotency-Key: the
// double replays the stored response, and the card is charged once.
func Example() {
	double := stripetest.New(stripetest.Options{})
	defer double.Close()
	double.Inject(stripetest.Fault{Kind: stripetest.FaultDropAfterCharge})

	// Without keep-alives, so net/http cannot hide the dropped connection by re-sending on its own.
	client := double.Client(&http.Client{Transport: &http.Transport{DisableKeepAlives: true}})
	charge := func() (*stripe.Charge, error) {
		params := &stripe.ChargeCreateParams{
			Amount:   stripe.Int64(4200),
			Currency: stripe.String("eur"),
			Source:   &stripe.PaymentSourceSourceParams{Token: stripe.String("tok_visa")},
		}
		params.SetIdempotencyKey("order-42-charge")
		return client.V1Charges.Create(context.Background(), params)
	}

	_, err := charge()
	fmt.Println("first attempt failed:", err != nil)
	ch, err := charge()
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("retry:", ch.Status, ch.Amount)
	fmt.Println("charges for the key:", double.ChargesFor("order-42-charge"))
	// Output:
	// first attempt failed: true
	// retry: succeeded 4200
	// charges for the key: 1
}
