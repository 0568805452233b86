package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// An operator reconciling with Stripe finds a call's stored result by its idempotency key (from a
// letter or a log) or by the object id Stripe shows (from Stripe's dashboard).
func TestAdminCallResultsByKeyAndObjectID(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := context.Background()
	b.startCallRelay(t, nil)
	paid := b.enqueue(t, chargeCall("recon-paid", 4200))
	other := b.enqueue(t, chargeCall("recon-other", 100))
	got := b.waitResult(t, paid)
	b.waitResult(t, other)
	require.NotEmpty(t, got.objectID)

	admin, err := relay.NewAdmin(relay.AdminConfig{Schema: b.env.Schema})
	require.NoError(t, err)
	byKey, err := admin.CallResults(ctx, b.env.Pool, relay.CallResultQuery{IdempotencyKey: paid})
	require.NoError(t, err)
	require.Len(t, byKey, 1)
	r := byKey[0]
	require.Equal(t, paid, r.IdempotencyKey)
	require.Equal(t, outbox.OutcomeSucceeded, r.Outcome)
	require.Equal(t, 200, r.HTTPStatus)
	require.Equal(t, got.objectID, r.ObjectID)
	require.Contains(t, r.Body, got.objectID)
	require.Equal(t, 1, r.Attempts)
	require.False(t, r.FirstAttemptAt.IsZero())
	require.False(t, r.CompletedAt.Before(r.FirstAttemptAt))
	require.NotEmpty(t, r.CallUUID)

	byObject, err := admin.CallResults(ctx, b.env.Pool, relay.CallResultQuery{ObjectID: got.objectID})
	require.NoError(t, err)
	require.Equal(t, byKey, byObject)

	both, err := admin.CallResults(ctx, b.env.Pool, relay.CallResultQuery{IdempotencyKey: other, ObjectID: got.objectID})
	require.NoError(t, err)
	require.Empty(t, both, "both conditions must match")
	none, err := admin.CallResults(ctx, b.env.Pool, relay.CallResultQuery{ObjectID: "ch_unknown"})
	require.NoError(t, err)
	require.Empty(t, none)

	succeededOnly, err := admin.CallResults(ctx, b.env.Pool, relay.CallResultQuery{Unsuccessful: true, Within: time.Hour})
	require.NoError(t, err)
	require.Empty(t, succeededOnly, "the one result succeeded")

	_, err = admin.CallResults(ctx, b.env.Pool, relay.CallResultQuery{})
	require.ErrorContains(t, err, "needs an IdempotencyKey, an ObjectID or Unsuccessful")
	_, err = admin.CallResults(ctx, b.env.Pool, relay.CallResultQuery{Unsuccessful: true, Within: -time.Second})
	require.ErrorContains(t, err, "CallResultQuery.Within")
	_, err = admin.CallResults(ctx, b.env.Pool, relay.CallResultQuery{ObjectID: "x", Limit: -1})
	require.ErrorContains(t, err, "CallResultQuery.Limit")
}
