package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/internal/sqlname"
)

// Lease is one shard's lease row as stored.
type Lease struct {
	Shard int `json:"shard"`
	// Shards is the layout the lease belongs to (Config.Shards of the relays that made it).
	Shards int `json:"shards"`
	// Owner is the relay holding or last holding the lease; "" when it was never taken or was
	// released.
	Owner string `json:"owner"`
	Token int64  `json:"token"`
	// ExpiresAt is when the lease runs out; nil for a lease never taken or given up (released).
	ExpiresAt *time.Time `json:"expires_at"`
	// Expired is true when the lease is free to take, by the database clock.
	Expired bool `json:"expired"`
}

// Leases returns the lease rows of the outbox in schema, by shard.
func Leases(ctx context.Context, db Queryer, schema string) ([]Lease, error) {
	rows, err := query(ctx, db, schema, leasesSQL)
	if err != nil {
		return nil, fmt.Errorf("relay: leases: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Lease, error) {
		var l Lease
		err := row.Scan(&l.Shard, &l.Shards, &l.Owner, &l.Token, &l.ExpiresAt, &l.Expired)
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("relay: leases: %w", err)
	}
	return out, nil
}

// Node is a relay process that registered itself (every LeaseTTL/3) to take its fair share.
type Node struct {
	Owner     string    `json:"owner"`
	ExpiresAt time.Time `json:"expires_at"`
	// Live is true while the registration has not expired, by the database clock.
	Live bool `json:"live"`
}

// Nodes returns the relays registered in schema, live ones first, then by owner. Registrations
// that expired more than an hour ago are pruned by the running relays.
func Nodes(ctx context.Context, db Queryer, schema string) ([]Node, error) {
	rows, err := query(ctx, db, schema, nodesSQL)
	if err != nil {
		return nil, fmt.Errorf("relay: relays: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Node, error) {
		var n Node
		err := row.Scan(&n.Owner, &n.ExpiresAt, &n.Live)
		return n, err
	})
	if err != nil {
		return nil, fmt.Errorf("relay: relays: %w", err)
	}
	return out, nil
}

// CallOutcome is the stored result of a call that did not succeed: declined or rejected.
type CallOutcome struct {
	IdempotencyKey string    `json:"idempotency_key"`
	Outcome        string    `json:"outcome"`
	HTTPStatus     int       `json:"http_status"`
	ObjectID       string    `json:"object_id"`
	Attempts       int       `json:"attempts"`
	CompletedAt    time.Time `json:"completed_at"`
}

// UnsuccessfulCalls returns up to limit call results other than succeeded that were completed in
// the last window, by the database clock, the most recent first.
func UnsuccessfulCalls(ctx context.Context, db Queryer, schema string, window time.Duration, limit int) ([]CallOutcome, error) {
	rows, err := query(ctx, db, schema, unsuccessfulCallsSQL, window.Milliseconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("relay: unsuccessful calls: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (CallOutcome, error) {
		var c CallOutcome
		err := row.Scan(&c.IdempotencyKey, &c.Outcome, &c.HTTPStatus, &c.ObjectID, &c.Attempts, &c.CompletedAt)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("relay: unsuccessful calls: %w", err)
	}
	return out, nil
}

func query(ctx context.Context, db Queryer, schema, template string, args ...any) (pgx.Rows, error) {
	quoted, err := sqlname.Schema(schema)
	if err != nil {
		return nil, err
	}
	return db.Query(ctx, sqlname.Render(template, quoted), args...)
}
