package outbox_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/migrations"
	"github.com/txbox/txbox/outbox"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type callBundle struct {
	env *txtest.Env
	w   *outbox.Writer
}

func setupCalls(t *testing.T) *callBundle {
	t.Helper()
	env := txtest.New(t)
	w, err := outbox.New(outbox.Config{Schema: env.Schema})
	require.NoError(t, err)
	return &callBundle{env: env, w: w}
}

// write runs Call in its own transaction, committed or rolled back.
func (b *callBundle) write(t *testing.T, ctx context.Context, commit bool, c outbox.Call) (string, error) {
	t.Helper()
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	key, err := b.w.Call(ctx, tx, c)
	if commit && err == nil {
		require.NoError(t, tx.Commit(ctx))
	} else {
		require.NoError(t, tx.Rollback(ctx))
	}
	return key, err
}

// handlerCtx is the context of a handler of consumer "payments" processing message "msg-1".
func handlerCtx() context.Context {
	return outbox.ContextWithSource(context.Background(), outbox.Source{Consumer: "payments", Handler: "billing", DedupKey: "msg-1"})
}

// begin begins a transaction that the test's end rolls back, unless it was committed.
func (b *callBundle) begin(t *testing.T, ctx context.Context) pgx.Tx {
	t.Helper()
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

func (b *callBundle) rows(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+b.env.Q("txbox_outbox")).Scan(&n))
	return n
}

func charge(name string) outbox.Call {
	return outbox.Call{
		Name: name, Path: "/v1/charges",
		Params: url.Values{"amount": {"1000"}, "currency": {"eur"}, "source": {"tok_visa"}},
	}
}

// A redelivered message is processed again only when its first processing rolled back; the call it
// writes again must carry the same key, or the provider would execute it twice.
func TestCallKeyIsStableAcrossRedeliveries(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := outbox.ContextWithSource(context.Background(), outbox.Source{Consumer: "payments", DedupKey: "msg-1"})

	first, err := b.write(t, ctx, false, charge("charge")) // the delivery whose consumer crashed
	require.NoError(t, err)
	require.Zero(t, b.rows(t), "a rolled-back handler writes no call")
	again, err := b.write(t, ctx, true, charge("charge")) // the redelivery
	require.NoError(t, err)
	require.Equal(t, first, again)
	require.Equal(t, outbox.IdempotencyKey(outbox.Source{Consumer: "payments", DedupKey: "msg-1"}, "charge"), again)
	require.True(t, strings.HasPrefix(again, "txbox_"), again)
	require.LessOrEqual(t, len(again), outbox.MaxIdempotencyKeyLength)
}

// Keys differ whenever any part of the source or the name differs; two handlers of one consumer
// making a call of the same name for the same message get two keys.
func TestCallKeysAreDistinct(t *testing.T) {
	t.Parallel()
	key := func(consumer, handler, dedupKey, name string) string {
		return outbox.IdempotencyKey(outbox.Source{Consumer: consumer, Handler: handler, DedupKey: dedupKey}, name)
	}
	keys := map[string]string{
		"the call":                    key("payments", "", "msg-1", "charge"),
		"another call of the message": key("payments", "", "msg-1", "refund"),
		"another message":             key("payments", "", "msg-2", "charge"),
		"another consumer":            key("billing", "", "msg-1", "charge"),
		"shifted boundaries":          key("payment", "", "smsg-1", "charge"),
		"a handler":                   key("payments", "charge", "msg-1", "charge"),
		"another handler":             key("payments", "email", "msg-1", "charge"),
		"handler shifted into key":    key("payments", "c", "harge", "msg-1"),
		"shifted handler boundaries":  key("payments", "chargem", "sg-1", "charge"),
	}
	seen := map[string]string{}
	for what, k := range keys {
		require.NotContains(t, seen, k, "%s shares a key with %s", what, seen[k])
		seen[k] = what
		require.Len(t, k, 49, what)
	}
	require.NotEqual(t, key("a", "", "bc", "d"), key("ab", "", "c", "d"))
}

// Outside a router (no handler) the key is derived as it was before handlers took part in it, so
// the keys of calls already written by existing deployments do not change. The value was computed
// by the derivation before handlers existed.
func TestCallKeyWithoutHandlerIsUnchanged(t *testing.T) {
	t.Parallel()
	require.Equal(t, "txbox_F3nPtJhsI1Cato6Hvs04Wi6GzZwsykS6AFJJw-iaIQw",
		outbox.IdempotencyKey(outbox.Source{Consumer: "payments", DedupKey: "msg-1"}, "charge"))
}

func TestCallStoresTheRequest(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := outbox.ContextWithSource(context.Background(), outbox.Source{Consumer: "payments", DedupKey: "msg-1"})
	c := charge("charge")
	c.Method = "post"
	c.Params.Set("metadata[order_id]", "o-7")
	c.StripeAccount = "acct_123"
	c.ReplyTopic = "charges.results"
	c.Metadata = map[string]string{"order_id": "o-7"}
	key, err := b.write(t, ctx, true, c)
	require.NoError(t, err)

	var (
		kind, topic, pk, id, idem, meta string
		slot                            int16
		payload                         []byte
		attempts                        int
		due                             bool
	)
	require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT kind, topic, partition_key, uuid, idempotency_key, metadata::text, slot, payload,
		attempts, next_attempt_at <= now() FROM `+b.env.Q("txbox_outbox")).
		Scan(&kind, &topic, &pk, &id, &idem, &meta, &slot, &payload, &attempts, &due))
	require.Equal(t, "call", kind)
	require.Equal(t, "charges.results", topic)
	require.Equal(t, key, idem)
	require.Equal(t, key, pk, "the partition key defaults to the idempotency key")
	require.Equal(t, outbox.CallUUID(key), id)
	require.Equal(t, outbox.SlotOf(key, id), slot)
	require.Zero(t, attempts)
	require.True(t, due, "a new call is due at once")

	var req outbox.CallRequest
	require.NoError(t, json.Unmarshal(payload, &req))
	require.Equal(t, outbox.CallRequest{
		Provider: outbox.ProviderStripe, Name: "charge", Method: "POST", Path: "/v1/charges",
		Params:        url.Values{"amount": {"1000"}, "currency": {"eur"}, "source": {"tok_visa"}, "metadata[order_id]": {"o-7"}},
		StripeAccount: "acct_123",
	}, req)
	var md map[string]string
	require.NoError(t, json.Unmarshal([]byte(meta), &md))
	require.Equal(t, "o-7", md["order_id"])
}

func TestCallWithExplicitKeyAndPartitionKey(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	c := charge("")
	c.IdempotencyKey = "order-7-charge"
	c.PartitionKey = "order-7"
	key, err := b.write(t, context.Background(), true, c) // no inbox source needed
	require.NoError(t, err)
	require.Equal(t, "order-7-charge", key)

	// An explicit key wins over the source in the context.
	ctx := outbox.ContextWithSource(context.Background(), outbox.Source{Consumer: "payments", DedupKey: "msg-1"})
	c.IdempotencyKey = "order-7-refund"
	key, err = b.write(t, ctx, true, c)
	require.NoError(t, err)
	require.Equal(t, "order-7-refund", key)

	var slots []int16
	rows, err := b.env.Pool.Query(ctx, "SELECT DISTINCT slot FROM "+b.env.Q("txbox_outbox")+" WHERE partition_key = 'order-7'")
	require.NoError(t, err)
	for rows.Next() {
		var s int16
		require.NoError(t, rows.Scan(&s))
		slots = append(slots, s)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []int16{outbox.SlotOf("order-7", "")}, slots, "one partition key, one slot")
}

// Two calls of one name in one handler would share a derived key, and the provider would execute
// only the first (the second gets its replay): the second is refused, nothing of it is written, and
// the first stays. Another name, an explicit key, and the same name in the next transaction (a
// retry of a rolled-back one) under the same context are not refused.
func TestASecondCallOfTheSameNameInOneTransactionIsRefused(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := handlerCtx()

	tx := b.begin(t, ctx) // a failed check must not leave the schema locked
	first, err := b.w.Call(ctx, tx, charge("charge"))
	require.NoError(t, err)
	_, err = b.w.Call(ctx, tx, charge("charge"))
	require.ErrorIs(t, err, outbox.ErrInvalidCall)
	require.ErrorContains(t, err, `Call.Name "charge" is already used`)
	require.ErrorContains(t, err, first, "the error names the shared key")
	// A savepoint the transaction keeps commits with it: a name used in it is refused around it
	// and in a sibling savepoint, whichever came first. The check knew the names per savepoint,
	// and let two sibling savepoints' "charge" share one key.
	sp, err := tx.Begin(ctx)
	require.NoError(t, err)
	_, err = b.w.Call(ctx, sp, charge("refund"))
	require.NoError(t, err, "another name, in a savepoint")
	require.NoError(t, sp.Commit(ctx))
	_, err = b.w.Call(ctx, tx, charge("charge"))
	require.ErrorIs(t, err, outbox.ErrInvalidCall, "the transaction's name, after a call in its savepoint")
	_, err = b.w.Call(ctx, tx, charge("refund"))
	require.ErrorIs(t, err, outbox.ErrInvalidCall, "the released savepoint's name, around it")
	sibling, err := tx.Begin(ctx)
	require.NoError(t, err)
	_, err = b.w.Call(ctx, sibling, charge("refund"))
	require.ErrorIs(t, err, outbox.ErrInvalidCall, "the released savepoint's name, in its sibling")
	require.NoError(t, sibling.Rollback(ctx))
	// A savepoint rolled back takes its call with it: its name is free again (a step retried).
	sp, err = tx.Begin(ctx)
	require.NoError(t, err)
	_, err = b.w.Call(ctx, sp, charge("fee"))
	require.NoError(t, err)
	require.NoError(t, sp.Rollback(ctx))
	_, err = b.w.Call(ctx, tx, charge("fee"))
	require.NoError(t, err, "the name of a call rolled back with its savepoint")
	explicit := charge("charge")
	explicit.IdempotencyKey = "order-7-charge"
	for range 2 {
		_, err = b.w.Call(ctx, tx, explicit)
		require.NoError(t, err, "an explicit key is the caller's to repeat")
	}
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 5, b.rows(t), "charge, the savepoint's refund, fee and the explicit key's two calls")

	again, err := b.write(t, ctx, false, charge("charge"))
	require.NoError(t, err, "the same name in the next transaction")
	require.Equal(t, first, again)
}

// A handler's transaction that writes a call, then one savepoint after another (a line item each),
// and calls through itself in between, refuses a second call of the first's name however many
// savepoints it opened: a check kept in memory forgot the transaction after eight, and the second
// "charge" shared the first's key.
func TestATransactionInUseIsRememberedAcrossManySavepoints(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := handlerCtx()
	tx := b.begin(t, ctx)
	_, err := b.w.Call(ctx, tx, charge("charge"))
	require.NoError(t, err)
	for i := range 100 {
		sp, err := tx.Begin(ctx)
		require.NoError(t, err)
		_, err = b.w.Call(ctx, sp, charge(fmt.Sprintf("item-%d", i)))
		require.NoError(t, err)
		require.NoError(t, sp.Commit(ctx))
		_, err = b.w.Call(ctx, tx, charge(fmt.Sprintf("fee-%d", i)))
		require.NoError(t, err)
	}
	_, err = b.w.Call(ctx, tx, charge("charge"))
	require.ErrorIs(t, err, outbox.ErrInvalidCall, "a second charge through the transaction, after 100 savepoints")
}

// Outside a transaction (a pool, a connection between transactions, a *sql.DB) each call is a
// transaction of its own, where a second call of a name for the message cannot be told from the
// first: a derived key is refused there, an explicit one is not. Inside a transaction begun by
// hand on a connection, the check works.
func TestADerivedCallOutsideATransactionIsRefused(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := handlerCtx()
	conn, err := b.env.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	db := stdlib.OpenDBFromPool(b.env.Pool)
	t.Cleanup(func() { _ = db.Close() })
	sqlConn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer sqlConn.Close()
	for name, tx := range map[string]outbox.Execer{
		"pool": b.env.Pool, "pool conn": conn, "conn": conn.Conn(), "sql.DB": outbox.FromSQL(db), "sql.Conn": outbox.FromSQL(sqlConn),
		// Types of the caller's, which the database is asked about.
		"wrapped pool": execOnly{b.env.Pool}, "wrapped sql.DB": outbox.FromSQL(struct{ *sql.DB }{db}),
	} {
		_, err := b.w.Call(ctx, tx, charge("charge"))
		require.ErrorIs(t, err, outbox.ErrInvalidCall, name)
		require.ErrorContains(t, err, "a call of a derived key needs a transaction", name)
		explicit := charge("charge")
		explicit.IdempotencyKey = "order-7-" + strings.ReplaceAll(name, " ", "-")
		_, err = b.w.Call(ctx, tx, explicit)
		require.NoError(t, err, name)
	}
	_, err = conn.Exec(ctx, "BEGIN")
	require.NoError(t, err)
	_, err = b.w.Call(ctx, conn, charge("charge"))
	require.NoError(t, err, "in a transaction begun by hand")
	_, err = b.w.Call(ctx, conn, charge("charge"))
	require.ErrorIs(t, err, outbox.ErrInvalidCall, "the second, in the same transaction")
	_, err = conn.Exec(ctx, "COMMIT")
	require.NoError(t, err)
	tx := b.begin(t, ctx)
	_, err = b.w.Call(ctx, execOnly{tx}, charge("refund"))
	require.NoError(t, err, "a transaction of a type of the caller's")
	_, err = b.w.Call(ctx, execOnly{tx}, charge("refund"))
	require.ErrorIs(t, err, outbox.ErrInvalidCall, "the second, in that transaction")
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 9, b.rows(t), "seven explicit calls and the derived two")
}

// execOnly hides every method of an Execer but Exec, as a caller's wrapper does.
type execOnly struct{ e outbox.Execer }

func (x execOnly) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return x.e.Exec(ctx, sql, args...)
}

// Handlers on a SERIALIZABLE database writing the calls of different messages at once do not fail
// each other: the check is a unique index's, not a read of the outbox, which took predicate locks
// and made the second commit fail with a serialization failure.
func TestSerializableWritersOfDifferentMessagesCallsDoNotConflict(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	bg := context.Background()
	var txs []pgx.Tx
	for i := range 2 {
		tx, err := b.env.Pool.BeginTx(bg, pgx.TxOptions{IsoLevel: pgx.Serializable})
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(bg) }()
		ctx := outbox.ContextWithSource(bg, outbox.Source{Consumer: "payments", Handler: "billing", DedupKey: fmt.Sprint("msg-", i)})
		_, err = b.w.Call(ctx, tx, charge("charge"))
		require.NoError(t, err)
		txs = append(txs, tx)
	}
	for i, tx := range txs {
		require.NoError(t, tx.Commit(bg), "transaction %d", i)
	}
}

// taglessTx is a wrapper of the kind services write (tracing, metrics) that returns no command tag.
type taglessTx struct{ pgx.Tx }

func (e taglessTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	_, err := e.Tx.Exec(ctx, sql, args...)
	return pgconn.CommandTag{}, err
}

// An Execer whose tag says nothing gets an error that says so, not that its call's name was used
// already.
func TestCallErrorsSayWhatIsWrong(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := handlerCtx()
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = b.w.Call(ctx, taglessTx{tx}, charge("charge"))
	require.ErrorContains(t, err, "a wrapper must pass pgx's tag on")
	require.NotErrorIs(t, err, outbox.ErrInvalidCall)
	require.NoError(t, tx.Rollback(ctx))
}

// New writers deployed before txbox migrate up ran: a write that needs a pending migration is
// ErrSchemaOutdated (which the inbox does not count as the message's failure), and so is any
// write where txbox is not installed; the writes the older schema serves go on.
func TestWritesNeedingAPendingMigrationAreErrSchemaOutdated(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	ctx := handlerCtx()
	db := stdlib.OpenDBFromPool(b.env.Pool)
	t.Cleanup(func() { _ = db.Close() })
	p, err := migrations.NewProvider(ctx, db, migrations.WithSchema(b.env.Schema))
	require.NoError(t, err)
	publish := func(w *outbox.Writer, n int) error {
		tx, err := b.env.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck // Its locks would hold the next migration up.
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(fmt.Sprintf("m-%d-%d", n, i), nil)
		}
		return w.Publish(ctx, tx, "orders", msgs...)
	}
	explicit := charge("charge")
	explicit.IdempotencyKey = "order-1"

	_, err = p.DownTo(ctx, 13) // writer_xact and its unique index
	require.NoError(t, err)
	_, err = b.write(t, ctx, false, charge("charge"))
	require.ErrorIs(t, err, outbox.ErrSchemaOutdated)
	require.ErrorContains(t, err, "run txbox migrate up")
	require.ErrorContains(t, err, "writer_xact", "the error names what is missing")
	_, err = b.write(t, ctx, false, explicit)
	require.NoError(t, err)
	require.NoError(t, publish(b.w, 2))

	_, err = p.DownTo(ctx, 9) // metadata as text
	require.NoError(t, err)
	require.ErrorIs(t, publish(b.w, 2), outbox.ErrSchemaOutdated)
	require.NoError(t, publish(b.w, 1))

	elsewhere, err := outbox.New(outbox.Config{Schema: "txbox_not_installed"})
	require.NoError(t, err)
	require.ErrorIs(t, publish(elsewhere, 1), outbox.ErrSchemaOutdated)
}

// hookedTx is a database/sql transaction wrapper of the kind a service may pass to FromSQL by
// value, with a func field.
type hookedTx struct {
	tx     *sql.Tx
	onExec func(query string)
}

func (h hookedTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	h.onExec(query)
	return h.tx.ExecContext(ctx, query, args...)
}

// Calls through a database/sql transaction, wrapped as services wrap them, are checked for names
// used twice as pgx's are: FromSQL passes the rows a write affected on. (The check once compared
// Execers, and a wrapper with a func field made the comparison panic.)
func TestCallsThroughADatabaseSQLTransactionAreChecked(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	db := stdlib.OpenDBFromPool(b.env.Pool)
	t.Cleanup(func() { _ = db.Close() })
	ctx := handlerCtx()

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	var execs []string
	h := hookedTx{tx: tx, onExec: func(query string) { execs = append(execs, strings.Fields(query)[0]) }}
	_, err = b.w.Call(ctx, outbox.FromSQL(h), charge("charge"))
	require.NoError(t, err)
	_, err = b.w.Call(ctx, outbox.FromSQL(h), charge("refund"))
	require.NoError(t, err)
	_, err = b.w.Call(ctx, outbox.FromSQL(tx), charge("charge"))
	require.ErrorIs(t, err, outbox.ErrInvalidCall, "the same transaction, wrapped or not")
	require.NoError(t, tx.Commit())
	// The wrapper is a type of the caller's: the database is asked whether it is in a transaction.
	require.Equal(t, []string{"SAVEPOINT", "RELEASE", "INSERT", "SAVEPOINT", "RELEASE", "INSERT"}, execs)
	require.Equal(t, 2, b.rows(t))
}

func TestCallRejectsWhatCannotBeExecuted(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	source := outbox.ContextWithSource(context.Background(), outbox.Source{Consumer: "payments", DedupKey: "msg-1"})
	with := func(f func(*outbox.Call)) outbox.Call {
		c := charge("charge")
		f(&c)
		return c
	}
	cases := []struct {
		name string
		ctx  context.Context
		call outbox.Call
	}{
		{"no source and no key", context.Background(), charge("charge")},
		{"no name to derive the key", source, charge("")},
		// Every such call would share one key: the provider would execute the first only.
		{"a source without a dedup key", outbox.ContextWithSource(context.Background(), outbox.Source{Consumer: "payments", Handler: "billing"}), charge("charge")},
		{"an empty source", outbox.ContextWithSource(context.Background(), outbox.Source{}), charge("charge")},
		{"a read", source, with(func(c *outbox.Call) { c.Method = "GET" })},
		{"not a Stripe path", source, with(func(c *outbox.Call) { c.Path = "/charges" })},
		{"a v2 path", source, with(func(c *outbox.Call) { c.Path = "/v2/core/events" })},
		{"a query string", source, with(func(c *outbox.Call) { c.Path = "/v1/charges?amount=1" })},
		{"a dot-dot path", source, with(func(c *outbox.Call) { c.Path = "/v1/../admin" })},
		{"a key over 255", source, with(func(c *outbox.Call) { c.IdempotencyKey = strings.Repeat("k", 256) })},
		{"a key with spaces around", source, with(func(c *outbox.Call) { c.IdempotencyKey = " k" })},
		{"a key with a newline", source, with(func(c *outbox.Call) { c.IdempotencyKey = "k\nX-Evil: 1" })},
		{"a bad Stripe-Account", source, with(func(c *outbox.Call) { c.StripeAccount = "acct_1\r\n" })},
		{"reserved metadata", source, with(func(c *outbox.Call) {
			c.Metadata = map[string]string{"_watermill_message_uuid": "x"}
		})},
	}
	for _, tc := range cases {
		_, err := b.write(t, tc.ctx, true, tc.call)
		require.ErrorIs(t, err, outbox.ErrInvalidCall, tc.name)
	}
	require.Zero(t, b.rows(t), "nothing was written")

	_, err := b.write(t, source, true, with(func(c *outbox.Call) { c.IdempotencyKey = strings.Repeat("k", 255) }))
	require.NoError(t, err, "255 characters is Stripe's limit, not over it")
}

func TestParseCallResult(t *testing.T) {
	t.Parallel()
	in := outbox.CallResult{
		CallUUID: outbox.CallUUID("k"), IdempotencyKey: "k", Outcome: outbox.OutcomeSucceeded,
		HTTPStatus: 200, ObjectID: "ch_1", Body: json.RawMessage(`{"id":"ch_1"}`), Attempts: 2,
	}
	payload, err := json.Marshal(in)
	require.NoError(t, err)
	out, err := outbox.ParseCallResult(message.NewMessage(outbox.ReplyUUID("k"), payload))
	require.NoError(t, err)
	require.Equal(t, in, out)

	_, err = outbox.ParseCallResult(message.NewMessage("x", []byte(`{"hello":"world"}`)))
	require.Error(t, err)
	require.NotEqual(t, outbox.CallUUID("k"), outbox.ReplyUUID("k"))
}

// Every text field of a call is checked like Publish checks a message's, by the same code: text
// PostgreSQL cannot store, or that JSON would silently rewrite, is refused with ErrInvalidCall
// naming the field, instead of a raw database error or a request other than the one written.
func TestCallRefusesTextItCannotStoreFaithfully(t *testing.T) {
	t.Parallel()
	b := setupCalls(t)
	source := outbox.ContextWithSource(context.Background(), outbox.Source{Consumer: "payments", DedupKey: "msg-1"})
	fields := map[string]func(*outbox.Call, string){
		"Name":           func(c *outbox.Call, v string) { c.Name = "charge" + v },
		"Method":         func(c *outbox.Call, v string) { c.Method = "POST" + v },
		"Path":           func(c *outbox.Call, v string) { c.Path = "/v1/charges" + v },
		"Params":         func(c *outbox.Call, v string) { c.Params.Set("description", "a"+v) },
		"Params key":     func(c *outbox.Call, v string) { c.Params.Set("metadata[k"+v+"]", "a") },
		"StripeAccount":  func(c *outbox.Call, v string) { c.StripeAccount = "acct_1" + v },
		"ReplyTopic":     func(c *outbox.Call, v string) { c.ReplyTopic = "charges" + v },
		"PartitionKey":   func(c *outbox.Call, v string) { c.PartitionKey = "order-7" + v },
		"IdempotencyKey": func(c *outbox.Call, v string) { c.IdempotencyKey = "k" + v },
		"Metadata":       func(c *outbox.Call, v string) { c.Metadata = map[string]string{"order": "7" + v} },
		"Metadata key":   func(c *outbox.Call, v string) { c.Metadata = map[string]string{"order" + v: "7"} },
	}
	for field, set := range fields {
		for what, v := range map[string]string{"NUL": "\x00", "invalid UTF-8": "\xff"} {
			c := charge("charge")
			set(&c, v)
			_, err := b.write(t, source, true, c)
			if !assert.ErrorIs(t, err, outbox.ErrInvalidCall, "%s with %s", field, what) {
				continue
			}
			assert.ErrorContains(t, err, strings.Fields(field)[0], "%s with %s: the error names the field", field, what)
		}
	}
	require.Zero(t, b.rows(t), "nothing was written")
}
