package relay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// CallResult is the stored outcome of a side-effect call the relay completed, kept for
// reconciliation (txbox_call_result; retention removes it after its CallResultRetention).
type CallResult struct {
	IdempotencyKey string
	CallUUID       string
	// Outcome is outbox.OutcomeSucceeded, OutcomeDeclined or OutcomeRejected.
	Outcome    string
	HTTPStatus int
	// ObjectID is the provider's object the call created or touched ("ch_…"); "" when none.
	ObjectID string
	// Body is the provider's response as stored: at most the relay's MaxResultBytes.
	Body     string
	Attempts int
	// Duration is how long the successful send took.
	Duration time.Duration
	// FirstAttemptAt is when the key was first sent; zero for results stored before migration
	// 00003.
	FirstAttemptAt time.Time
	CompletedAt    time.Time
}

// CallResultQuery selects call results; its conditions combine with AND. At least one of
// IdempotencyKey, ObjectID and Unsuccessful is required.
type CallResultQuery struct {
	// IdempotencyKey selects the result of the calls with this key.
	IdempotencyKey string
	// ObjectID selects the results that name this provider object ("ch_…", "pi_…").
	ObjectID string
	// Unsuccessful selects the results other than succeeded: declined or rejected calls.
	Unsuccessful bool
	// Within selects the results completed less than this long ago, by the database clock.
	Within time.Duration
	// Limit is the most results returned, the most recent first. If not specified, defaults to
	// 100; at most 10000.
	Limit int
}

// CallResults returns the stored results q selects, the most recently completed first: what an
// operator reconciling with the provider looks up, from a letter's idempotency key or from an
// object id the provider shows.
func (a *Admin) CallResults(ctx context.Context, db Queryer, q CallResultQuery) ([]CallResult, error) {
	switch {
	case q.IdempotencyKey == "" && q.ObjectID == "" && !q.Unsuccessful:
		return nil, errors.New("relay: CallResultQuery needs an IdempotencyKey, an ObjectID or Unsuccessful")
	case q.Within < 0:
		return nil, fmt.Errorf("relay: CallResultQuery.Within must not be negative, got %s", q.Within)
	case q.Limit < 0 || q.Limit > 10000:
		return nil, fmt.Errorf("relay: CallResultQuery.Limit must be between 1 and 10000 (0 means 100), got %d", q.Limit)
	}
	opt := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	limit := q.Limit
	if limit == 0 {
		limit = 100
	}
	var within any
	if q.Within > 0 {
		within = q.Within.Milliseconds()
	}
	rows, err := db.Query(ctx, a.sql.callResults, opt(q.IdempotencyKey), opt(q.ObjectID), q.Unsuccessful, within, limit)
	if err != nil {
		return nil, fmt.Errorf("relay: call results: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (CallResult, error) {
		var (
			c     CallResult
			ms    int64
			first *time.Time
		)
		err := row.Scan(&c.IdempotencyKey, &c.CallUUID, &c.Outcome, &c.HTTPStatus, &c.ObjectID, &c.Body, &c.Attempts, &ms,
			&first, &c.CompletedAt)
		c.Duration = time.Duration(ms) * time.Millisecond
		if first != nil {
			c.FirstAttemptAt = *first
		}
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("relay: call results: %w", err)
	}
	return out, nil
}
