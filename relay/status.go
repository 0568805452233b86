package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
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

// Leases returns the lease rows, by shard.
func (a *Admin) Leases(ctx context.Context, db Queryer) ([]Lease, error) {
	rows, err := db.Query(ctx, a.sql.leases)
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

// Nodes returns the registered relays, live ones first, then by owner. Registrations that expired
// more than an hour ago are pruned by the running relays.
func (a *Admin) Nodes(ctx context.Context, db Queryer) ([]Node, error) {
	rows, err := db.Query(ctx, a.sql.nodes)
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
