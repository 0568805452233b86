package chaos

import (
	"context"
	"fmt"
	"slices"
	"sort"

	"github.com/jackc/pgx/v5"
)

// Message is one committed message.
type Message struct {
	UUID, Key string
}

// Effect is one application of a message's business effect by a consumer.
type Effect struct {
	Consumer, UUID, Key string
}

// DeadLetter is one row of the dead-letter table.
type DeadLetter struct {
	UUID, Reason string
}

// Outcome is what a run left behind, as the invariants see it.
type Outcome struct {
	// Committed lists the committed messages; messages with one key are in commit order.
	Committed []Message
	// RolledBack lists the UUIDs of messages whose transaction rolled back.
	RolledBack []string
	// Consumers names the consumers that must each have applied every committed message.
	Consumers []string
	// Effects lists every application of a business effect, in the order they were applied.
	Effects []Effect
	// Pending is the number of rows left in the outbox.
	Pending int
	// DeadLetters lists the dead letters; a run of valid messages must leave none.
	DeadLetters []DeadLetter
	// Charges, when set, returns how many times the payment provider charged for an idempotency
	// key; each consumer's charge for each committed message (ChargeKey) must have been made once.
	Charges func(idempotencyKey string) int
}

// Violation is one broken invariant.
type Violation struct {
	// Kind is one of the Violation* constants.
	Kind                string
	Consumer, Key, UUID string
	Detail              string
}

// Kinds of Violation.
const (
	ViolationLost      = "lost"      // a committed message never applied by a consumer
	ViolationDuplicate = "duplicate" // a message applied more than once by a consumer
	ViolationPhantom   = "phantom"   // an effect of a message that was never committed
	ViolationOrder     = "order"     // a key's messages first applied out of commit order
	ViolationPending   = "pending"   // rows left in the outbox
	ViolationDead      = "dead"      // a valid message dead-lettered
	ViolationCharges   = "charges"   // not exactly one external charge for a key
)

func (v Violation) String() string {
	s := v.Kind
	for _, f := range []struct{ name, val string }{{"consumer", v.Consumer}, {"key", v.Key}, {"uuid", v.UUID}} {
		if f.val != "" {
			s += " " + f.name + "=" + f.val
		}
	}
	if v.Detail != "" {
		s += ": " + v.Detail
	}
	return s
}

// Check returns every invariant o breaks; none means the run kept txbox's guarantees.
func Check(o Outcome) []Violation {
	var out []Violation
	committed := make(map[string]Message, len(o.Committed))
	byKey := map[string][]string{}
	for _, m := range o.Committed {
		committed[m.UUID] = m
		byKey[m.Key] = append(byKey[m.Key], m.UUID)
	}
	rolledBack := map[string]bool{}
	for _, u := range o.RolledBack {
		rolledBack[u] = true
	}

	for _, c := range o.Consumers {
		applied := map[string]int{}
		firstOrder := map[string][]string{} // key → UUIDs in order of first application
		for _, e := range o.Effects {
			if e.Consumer != c {
				continue
			}
			m, ok := committed[e.UUID]
			if !ok {
				detail := "never committed"
				if rolledBack[e.UUID] {
					detail = "its transaction rolled back"
				}
				out = append(out, Violation{Kind: ViolationPhantom, Consumer: c, Key: e.Key, UUID: e.UUID, Detail: detail})
				continue
			}
			applied[e.UUID]++
			if applied[e.UUID] == 1 {
				firstOrder[m.Key] = append(firstOrder[m.Key], e.UUID)
			}
		}
		for _, m := range o.Committed {
			switch n := applied[m.UUID]; {
			case n == 0:
				out = append(out, Violation{Kind: ViolationLost, Consumer: c, Key: m.Key, UUID: m.UUID, Detail: "committed, never applied"})
			case n > 1:
				out = append(out, Violation{Kind: ViolationDuplicate, Consumer: c, Key: m.Key, UUID: m.UUID, Detail: fmt.Sprintf("applied %d times", n)})
			}
		}
		for _, key := range sortedKeys(byKey) {
			if key == "" {
				continue // Messages without a key have no order to keep.
			}
			got := firstOrder[key]
			want := slices.DeleteFunc(slices.Clone(byKey[key]), func(u string) bool { return applied[u] == 0 })
			if i := firstDifference(got, want); i >= 0 {
				out = append(out, Violation{Kind: ViolationOrder, Consumer: c, Key: key, UUID: got[i],
					Detail: fmt.Sprintf("applied as #%d of the key, but #%d in commit order was %s", i+1, i+1, want[i])})
			}
		}
		if o.Charges != nil {
			for _, m := range o.Committed {
				if n := o.Charges(ChargeKey(c, m.UUID)); n != 1 {
					out = append(out, Violation{Kind: ViolationCharges, Consumer: c, Key: m.Key, UUID: m.UUID, Detail: fmt.Sprintf("%d charges", n)})
				}
			}
		}
	}
	if o.Pending > 0 {
		out = append(out, Violation{Kind: ViolationPending, Detail: fmt.Sprintf("%d rows left in the outbox", o.Pending)})
	}
	for _, d := range o.DeadLetters {
		out = append(out, Violation{Kind: ViolationDead, UUID: d.UUID, Detail: d.Reason})
	}
	return out
}

// firstDifference returns the first index where a and b differ, or -1; they hold the same set.
func firstDifference(a, b []string) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

func sortedKeys(m map[string][]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// Querier is the part of pgx that Collect needs.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Collect reads an Outcome from schema: the ledger, the effects, the outbox and the dead-letter
// table. The caller adds RolledBack, Consumers and Charges.
func Collect(ctx context.Context, db Querier, schema string) (Outcome, error) {
	var o Outcome
	var err error
	o.Committed, err = query(ctx, db, "SELECT uuid, key FROM "+table(schema, "produced")+" ORDER BY seq",
		func(r pgx.CollectableRow) (Message, error) {
			var m Message
			return m, r.Scan(&m.UUID, &m.Key)
		})
	if err != nil {
		return o, err
	}
	o.Effects, err = query(ctx, db, "SELECT consumer, uuid, key FROM "+table(schema, "effects")+" ORDER BY seq",
		func(r pgx.CollectableRow) (Effect, error) {
			var e Effect
			return e, r.Scan(&e.Consumer, &e.UUID, &e.Key)
		})
	if err != nil {
		return o, err
	}
	o.DeadLetters, err = query(ctx, db, "SELECT uuid, reason FROM "+table(schema, "txbox_dlq")+" ORDER BY id",
		func(r pgx.CollectableRow) (DeadLetter, error) {
			var d DeadLetter
			return d, r.Scan(&d.UUID, &d.Reason)
		})
	if err != nil {
		return o, err
	}
	pending, err := query(ctx, db, "SELECT count(*)::int FROM "+table(schema, "txbox_outbox"), pgx.RowTo[int])
	if err != nil {
		return o, err
	}
	o.Pending = pending[0]
	return o, nil
}

func query[T any](ctx context.Context, db Querier, sql string, scan pgx.RowToFunc[T]) ([]T, error) {
	rows, err := db.Query(ctx, sql)
	if err != nil {
		return nil, fmt.Errorf("chaos: %s: %w", sql, err)
	}
	out, err := pgx.CollectRows(rows, scan)
	if err != nil {
		return nil, fmt.Errorf("chaos: %s: %w", sql, err)
	}
	return out, nil
}
