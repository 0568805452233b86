package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

// scanBacklog is how many rows are pending in the tests below: far more than any batch, so that a
// read that walks the backlog touches tens of times more than the bounds allow.
const scanBacklog = 200_000

// scanShards is the layout of the tests below; idleShard has no rows at all, busyShard its share.
const (
	scanShards = DefaultShards
	idleShard  = 3
	busyShard  = 2
)

// backlogEnv is a schema holding about scanBacklog rows, a tenth of them calls, spread over every
// slot but idleShard's, with statistics up to date. Messages have 1000 partition keys; each call
// has its own, as charges of distinct orders do: a call waits behind an earlier call of its key,
// and a read passes over the calls that wait, so a backlog of calls on one key is walked by
// every read of its slot until the call ahead completes.
func backlogEnv(t *testing.T) (*txtest.Env, queries) {
	t.Helper()
	env := txtest.New(t)
	ctx := context.Background()
	_, err := env.Pool.Exec(ctx, `INSERT INTO `+env.Q("txbox_outbox")+` (kind, slot, topic, partition_key, uuid, payload, idempotency_key)
		SELECT CASE WHEN g % 10 = 0 THEN 'call' ELSE 'message' END, g % 256, 't',
			CASE WHEN g % 10 = 0 THEN 'order-' || g ELSE 'key-' || (g % 1000) END, g::text,
			convert_to(repeat('x', 200), 'UTF8'), CASE WHEN g % 10 = 0 THEN 'idem-' || g END
		FROM generate_series(1, $1) AS g WHERE g % 256 % $2 <> $3`, scanBacklog, scanShards, idleShard)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := env.Pool.Exec(ctx, "ANALYZE "+env.Q("txbox_outbox")); err != nil {
		t.Fatal(err)
	}
	schema, err := sqlname.Schema(env.Schema)
	if err != nil {
		t.Fatal(err)
	}
	return env, renderQueries(schema, outbox.Slots/scanShards)
}

// touched runs sql under EXPLAIN (ANALYZE, BUFFERS) and returns the rows its plan nodes produced
// or filtered out, summed over the plan, and the buffers it touched. It explains both the plan
// PostgreSQL makes for the first executions of a prepared statement (custom) and the one it
// switches to later (generic), and returns the larger figures.
func touched(t *testing.T, env *txtest.Env, sql string, args ...any) (rows, buffers float64) {
	t.Helper()
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		p := explain(t, env, mode, sql, args)
		rows = max(rows, p.rows())
		buffers = max(buffers, p.SharedHit+p.SharedRead)
	}
	return rows, buffers
}

// explain prepares sql and explains its execution with args under plan_cache_mode mode, in a
// transaction it rolls back.
func explain(t *testing.T, env *txtest.Env, mode, sql string, args []any) planNode {
	t.Helper()
	ctx := context.Background()
	tx, err := env.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT set_config('plan_cache_mode', $1, true)", mode); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "PREPARE scan_probe AS "+sql); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = tx.Exec(ctx, "DEALLOCATE scan_probe") }()
	var out []byte
	if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE scan_probe"+params(t, args)).Scan(&out); err != nil {
		t.Fatalf("explain (%s): %v", mode, err)
	}
	var plans []struct{ Plan planNode }
	if err := json.Unmarshal(out, &plans); err != nil {
		t.Fatal(err)
	}
	return plans[0].Plan
}

// params is the argument list of EXECUTE for args, as literals (EXECUTE takes no parameters of its
// own): id, slot and ctid lists, integers.
func params(t *testing.T, args []any) string {
	if len(args) == 0 {
		return ""
	}
	list := make([]string, len(args))
	for i, a := range args {
		switch a := a.(type) {
		case []int16:
			slots := make([]string, len(a))
			for j, s := range a {
				slots[j] = strconv.Itoa(int(s))
			}
			list[i] = "'{" + strings.Join(slots, ",") + "}'"
		case []int64:
			ids := make([]string, len(a))
			for j, id := range a {
				ids[j] = strconv.FormatInt(id, 10)
			}
			list[i] = "'{" + strings.Join(ids, ",") + "}'"
		case []pgtype.TID:
			tids := make([]string, len(a))
			for j, tid := range a {
				tids[j] = fmt.Sprintf(`"(%d,%d)"`, tid.BlockNumber, tid.OffsetNumber)
			}
			list[i] = "'{" + strings.Join(tids, ",") + "}'"
		case int:
			list[i] = strconv.Itoa(a)
		default:
			t.Fatalf("params: %T", a)
		}
	}
	return "(" + strings.Join(list, ", ") + ")"
}

type planNode struct {
	ActualRows     float64    `json:"Actual Rows"`
	ActualLoops    float64    `json:"Actual Loops"`
	RemovedFilter  float64    `json:"Rows Removed by Filter"`
	RemovedRecheck float64    `json:"Rows Removed by Index Recheck"`
	SharedHit      float64    `json:"Shared Hit Blocks"`
	SharedRead     float64    `json:"Shared Read Blocks"`
	Plans          []planNode `json:"Plans"`
}

// rows is what the node and those below it produced or threw away, over all their loops (EXPLAIN
// reports both per loop).
func (p planNode) rows() float64 {
	n := (p.ActualRows + p.RemovedFilter + p.RemovedRecheck) * max(p.ActualLoops, 1)
	for _, c := range p.Plans {
		n += c.rows()
	}
	return n
}

// Each statement the relay repeats per batch or per look touches rows and buffers in proportion to
// its batch and its slots, never to the backlog: neither for a shard with no rows while other
// shards have 200k pending (the case that walked the whole backlog), nor for a shard with a backlog
// of its own.
func TestReadsAreBoundedByTheBatch(t *testing.T) {
	t.Parallel()
	env, q := backlogEnv(t)
	slots := outbox.Slots / scanShards
	const batch = 100
	// The first batch of busyShard's messages, as a completion deletes them.
	rows, err := env.Pool.Query(context.Background(), "SELECT ctid, id FROM "+env.Q("txbox_outbox")+
		" WHERE kind = 'message' AND slot % $1 = $2 ORDER BY id LIMIT $3", scanShards, busyShard, batch)
	if err != nil {
		t.Fatal(err)
	}
	var first completion
	var tid pgtype.TID
	var id int64
	if _, err := pgx.ForEachRow(rows, []any{&tid, &id}, func() error {
		first.tids, first.ids = append(first.tids, tid), append(first.ids, id)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	const token = 7 // Both shards' leases, held under it.
	if _, err := env.Pool.Exec(context.Background(), "INSERT INTO "+env.Q("txbox_lease")+
		" (shard, shards, owner, token, expires_at) VALUES ($1, $3, 'scan', $4, 'infinity'), ($2, $3, 'scan', $4, 'infinity')",
		idleShard, busyShard, scanShards, token); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		sql   string
		batch int // rows it may return or change
		args  func(shard int) []any
	}{
		{"read messages", q.readMessages, batch, func(shard int) []any { return []any{slotsOf(shard, scanShards), batch, DefaultBatchBytes} }},
		{"read one slot's messages", q.readSlotMessages, batch, func(shard int) []any {
			return []any{slotsOf(shard, scanShards)[:1], batch, DefaultBatchBytes}
		}},
		{"read calls", q.readCalls, DefaultCallBatchSize, func(shard int) []any {
			return []any{slotsOf(shard, scanShards), DefaultCallBatchSize}
		}},
		{"look for calls a relay without calls holds", q.strandedCalls, 0, func(shard int) []any { return []any{slotsOf(shard, scanShards)} }},
		{"look for due messages", q.dueSlots, 0, func(shard int) []any { return []any{slotsOf(shard, scanShards)} }},
		{"look for due messages and balance", q.dueSlotsOrBalance, 0, func(shard int) []any { return []any{slotsOf(shard, scanShards), scanShards, 1} }},
		{"complete messages", q.completeMessages, batch, func(shard int) []any { return []any{first.tids, first.ids, shard, token} }},
	} {
		for _, shard := range []int{idleShard, busyShard} {
			rows, buffers := touched(t, env, tc.sql, tc.args(shard)...)
			// Per row returned, its trip up the plan (index scan, limit, merge, limit) and the look
			// for an earlier row of its key (a subplan of three nodes); per slot, one index
			// descent and the row it reads ahead.
			rowBound, bufferBound := float64(10*(tc.batch+slots)), float64(8*(tc.batch+slots))
			t.Logf("%s, shard %d: %.0f rows (bound %.0f), %.0f buffers (bound %.0f)", tc.name, shard, rows, rowBound, buffers, bufferBound)
			if rows > rowBound || buffers > bufferBound {
				t.Errorf("%s of shard %d touched %.0f rows and %.0f buffers with %d rows pending; want at most %.0f and %.0f",
					tc.name, shard, rows, buffers, scanBacklog, rowBound, bufferBound)
			}
		}
	}
}

// The gauges' query reads a bounded part of the backlog: an exact count up to its limit, then
// PostgreSQL's estimate, close to the real count; the oldest row among the first few by id. It
// counted and aged the whole outbox, every StatsInterval in every relay process, so its cost grew
// with the backlog an outage leaves.
func TestTheGaugesQueryIsBoundedByItsLimits(t *testing.T) {
	t.Parallel()
	env, q := backlogEnv(t)
	ctx := context.Background()
	const countLimit, oldestAmong = 1000, 100
	rows, buffers := touched(t, env, q.stats, countLimit, oldestAmong)
	t.Logf("%.0f rows, %.0f buffers with %d pending", rows, buffers, scanBacklog)
	if bound := float64(4 * (countLimit + oldestAmong)); rows > bound || buffers > bound {
		t.Errorf("the gauges' query touched %.0f rows and %.0f buffers with %d rows pending; want at most %.0f of each",
			rows, buffers, scanBacklog, bound)
	}

	var pending int64
	if err := env.Pool.QueryRow(ctx, "SELECT count(*) FROM "+env.Q("txbox_outbox")).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	var estimate, small int64
	var age, smallAge float64
	if err := env.Pool.QueryRow(ctx, q.stats, countLimit, oldestAmong).Scan(&estimate, &age); err != nil {
		t.Fatal(err)
	}
	if estimate < pending*9/10 || estimate > pending*11/10 {
		t.Errorf("backlog estimated at %d with %d pending; want within 10%%", estimate, pending)
	}
	if err := env.Pool.QueryRow(ctx, q.stats, pending+1, oldestAmong).Scan(&small, &smallAge); err != nil {
		t.Fatal(err)
	}
	if small != pending {
		t.Errorf("backlog counted as %d under a limit above it; want the exact %d", small, pending)
	}
	var oldest float64
	if err := env.Pool.QueryRow(ctx, "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM "+env.Q("txbox_outbox")).Scan(&oldest); err != nil {
		t.Fatal(err)
	}
	if age < oldest-1 || age > oldest+1 {
		t.Errorf("oldest pending %.1f s old; want %.1f", age, oldest)
	}
}

// Every statement of every shard layout is one PostgreSQL accepts. A read over a shard of one
// slot (256 shards, and a shard the look woke for one slot) was "(... ORDER BY o.id LIMIT $2)
// ORDER BY id LIMIT $2", which PostgreSQL refuses: a relay with --shards 256 read nothing, ever.
func TestEveryLayoutsStatementsAreValid(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	schema, err := sqlname.Schema(env.Schema)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	conn, err := env.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for shards := 1; shards <= outbox.Slots; shards *= 2 {
		q := reflect.ValueOf(renderQueries(schema, outbox.Slots/shards))
		for i := range q.NumField() {
			if _, err := conn.Conn().Prepare(ctx, "", q.Field(i).String()); err != nil {
				t.Errorf("%d shards: %s: %v", shards, q.Type().Field(i).Name, err)
			}
		}
	}
}
