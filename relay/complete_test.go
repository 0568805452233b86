package relay

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

// A completion finds each row by where it was read and deletes it only if it is still the row that
// was read: a row now in the place of another (one deleted meanwhile, its place reused after a
// vacuum) is not deleted unpublished, and a row that moved (updated meanwhile) stays pending.
func TestACompletionDeletesOnlyTheRowsItRead(t *testing.T) {
	t.Parallel()
	env := txtest.New(t)
	ctx := context.Background()
	schema, err := sqlname.Schema(env.Schema)
	require.NoError(t, err)
	q := renderQueries(schema, outbox.Slots)
	_, err = env.Pool.Exec(ctx, "INSERT INTO "+env.Q("txbox_lease")+" (shard, shards, owner, token, expires_at) VALUES (0, 1, 'me', 7, 'infinity')")
	require.NoError(t, err)
	_, err = env.Pool.Exec(ctx, "INSERT INTO "+env.Q("txbox_outbox")+" (kind, slot, topic, partition_key, uuid, payload) "+
		"SELECT 'message', 0, 't', '', g::text, '' FROM generate_series(1, 4) AS g")
	require.NoError(t, err)
	type row struct {
		tid pgtype.TID
		id  int64
	}
	read := func() map[string]row {
		rows, err := env.Pool.Query(ctx, "SELECT uuid, ctid, id FROM "+env.Q("txbox_outbox"))
		require.NoError(t, err)
		out := map[string]row{}
		var uuid string
		var r row
		_, err = pgx.ForEachRow(rows, []any{&uuid, &r.tid, &r.id}, func() error { out[uuid] = r; return nil })
		require.NoError(t, err)
		return out
	}
	before := read()
	// Row 4 moves: an update writes a new version elsewhere.
	_, err = env.Pool.Exec(ctx, "UPDATE "+env.Q("txbox_outbox")+" SET last_error = 'moved' WHERE uuid = '4'")
	require.NoError(t, err)
	require.NotEqual(t, before["4"].tid, read()["4"].tid, "the update moved row 4")

	complete := func(pairs ...row) int64 {
		var c completion
		for _, p := range pairs {
			c.tids, c.ids = append(c.tids, p.tid), append(c.ids, p.id)
		}
		tag, err := env.Pool.Exec(ctx, q.completeMessages, c.tids, c.ids, 0, 7)
		require.NoError(t, err)
		return tag.RowsAffected()
	}
	// Row 2's place with row 1's id, row 1's place with row 3's id: neither is the row read there.
	require.Zero(t, complete(row{before["2"].tid, before["1"].id}, row{before["1"].tid, before["3"].id}))
	require.Zero(t, complete(before["4"]), "row 4 as it was read")
	require.EqualValues(t, 2, complete(before["1"], before["3"]))
	left := read()
	require.Len(t, left, 2)
	require.Contains(t, left, "2")
	require.Contains(t, left, "4")
}
