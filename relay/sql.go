package relay

import (
	"fmt"
	"strings"

	"github.com/txbox/txbox/internal/sqlname"
)

// setBounds bounds, for the rest of a transaction, how long a statement waits for a lock ($1), how
// long a statement runs ($2), and how long the session may sit idle inside the transaction before
// PostgreSQL ends the session ($3), all in milliseconds. A process frozen inside a transaction (a
// GC pause, SIGSTOP, a VM freeze) then holds its locks for $3 at most, and nobody waits for a lock
// longer than $1: a frozen process delays no one else's renewal.
//
// It also sets plan_cache_mode to $4, or leaves it as it is when $4 is empty. The relay's own
// statements run with generic plans from their first execution on a connection (genericPlans):
// PostgreSQL plans a prepared statement anew for each of its first five executions on a
// connection, and a shard's read (bySlot, one branch per slot) took ~10 ms to plan on a new
// connection and ~1.3 ms for each of the next four, which every shard paid on its own connection
// at start-up, at once. The generic plans are the ones relay/scan_test.go proves bounded by the
// batch. Admin's statements, whose optional filters want custom plans, pass "".
const setBounds = `SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true),
	set_config('idle_in_transaction_session_timeout', $3, true),
	set_config('plan_cache_mode', coalesce(nullif($4::text, ''), current_setting('plan_cache_mode')), true)`

// genericPlans is setBounds' $4 for the relay's own statements.
const genericPlans = "force_generic_plan"

type queries struct {
	layoutLock, liveOtherLayout, dropOtherLayout, retiredLeases, dropRetired, createLeases,
	identity, heartbeat, liveOtherPrefix, forgetNode, liveNodes, pruneNodes, nextExpiry,
	acquire, missingLeases, renew, release, checkLease,
	readMessages, readSlotMessages, dueSlots, dueSlotsOrBalance, refuseMessage, deleteRows, buryRow, completeMessages, stats, strandedCalls string

	readCalls, startCall, rescheduleCall, insertCallResult string
}

// renderQueries renders the relay's statements for schema and a layout of slots slots per shard.
func renderQueries(schema string, slots int) queries {
	r := func(s string) string { return sqlname.Render(s, schema) }
	return queries{
		// Relays starting at once take turns checking the layout. Not a table lock: one queues
		// behind any row lock (a relay frozen in a fenced transaction holds one) and every renewal
		// then queues behind it.
		layoutLock: r(`SELECT pg_advisory_xact_lock(hashtextextended('{schema}.txbox_lease', 0))`),
		// A live lease, or a live relay registered, of another layout than $1 (relays other than $2).
		liveOtherLayout: r(`SELECT shards FROM {schema}.txbox_lease WHERE shards <> $1 AND owner IS NOT NULL AND expires_at > now()
			UNION ALL
			SELECT shards FROM {schema}.txbox_relay_node WHERE shards <> $1 AND owner <> $2 AND expires_at > now()
			LIMIT 1`),
		// Only dead leases: a relay of the other layout may have taken one since the check. Only
		// those of shards the layout $1 has too, which it replaces: the others are retired
		// (Relay.retireShards).
		dropOtherLayout: r(`DELETE FROM {schema}.txbox_lease WHERE shards <> $1 AND shard < $1 AND (owner IS NULL OR expires_at <= now())`),
		// The dead leases of shards the layout $1 lacks, and their deletion ($2 the shards).
		retiredLeases: r(`SELECT shard FROM {schema}.txbox_lease WHERE shard >= $1 AND (owner IS NULL OR expires_at <= now()) ORDER BY shard`),
		dropRetired:   r(`DELETE FROM {schema}.txbox_lease WHERE shard >= $1 AND shard = ANY($2) AND (owner IS NULL OR expires_at <= now())`),
		// Inserts only missing rows, so it never meets (or waits for) a row another relay holds.
		createLeases: r(`INSERT INTO {schema}.txbox_lease (shard, shards)
			SELECT s, $1 FROM generate_series(0, $1 - 1) AS s
			WHERE NOT EXISTS (SELECT 1 FROM {schema}.txbox_lease AS l WHERE l.shard = s)
			ON CONFLICT (shard) DO NOTHING`),

		identity: r(`SELECT outbox_id FROM {schema}.txbox_identity`),
		heartbeat: r(`INSERT INTO {schema}.txbox_relay_node (owner, expires_at, transactional_id_prefix, shards)
			VALUES ($1, now() + $2 * interval '1 millisecond', nullif($3, ''), $4)
			ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at,
				transactional_id_prefix = excluded.transactional_id_prefix, shards = excluded.shards`),
		// A live relay of the outbox that publishes with another transactional-ID prefix than $2,
		// or, unless $3 (the prefix was configured), one of a version before migration 00012, which
		// records neither its prefix nor its shard count (its prefix is "" here). A relay of that version
		// counts until $4 ms (a Kafka transaction's timeout) after its heartbeat ran out: one that
		// died without stopping left its open transactions to the broker, which aborts them only
		// then. Whether it is alive, and the milliseconds until it no longer counts, come with it.
		liveOtherPrefix: r(`SELECT owner, coalesce(transactional_id_prefix, ''), expires_at > now(),
				ceil(extract(epoch FROM expires_at + $4 * interval '1 millisecond' - now()) * 1000)::bigint
			FROM {schema}.txbox_relay_node
			WHERE owner <> $1 AND (expires_at > now() AND transactional_id_prefix <> $2
				OR shards IS NULL AND NOT $3 AND expires_at + $4 * interval '1 millisecond' > now())
			ORDER BY expires_at DESC LIMIT 1`),
		forgetNode: r(`DELETE FROM {schema}.txbox_relay_node WHERE owner = $1`),
		liveNodes:  r(`SELECT count(*) FROM {schema}.txbox_relay_node WHERE expires_at > now()`),
		pruneNodes: r(`DELETE FROM {schema}.txbox_relay_node WHERE expires_at < now() - interval '1 hour'`),
		// Milliseconds until the next lease or relay of others runs out (NULL: none will), so a
		// relay looks for leases to take right then rather than up to a renewal period later.
		nextExpiry: r(`SELECT (extract(epoch FROM least(
				(SELECT min(expires_at) FROM {schema}.txbox_lease WHERE shards = $2 AND owner IS DISTINCT FROM $1 AND expires_at > now()),
				(SELECT min(expires_at) FROM {schema}.txbox_relay_node WHERE owner <> $1 AND expires_at > now())
			) - now()) * 1000)::bigint`),

		// Only a free or expired lease is taken, by the database's clock; the token comes from a
		// sequence, so it is new even for the same owner.
		acquire: r(`UPDATE {schema}.txbox_lease SET owner = $1, token = nextval('{schema}.txbox_lease_token'),
				expires_at = now() + $2 * interval '1 millisecond'
			WHERE shard IN (SELECT shard FROM {schema}.txbox_lease
				WHERE shards = $3 AND expires_at <= now() ORDER BY shard LIMIT $4 FOR UPDATE SKIP LOCKED)
			RETURNING shard, token`),
		// How many leases of the layout $1 the table lacks: all of them after the tables were
		// dropped and made again (txbox migrate down, then up) under a running relay.
		missingLeases: r(`SELECT $1 - count(*) FROM {schema}.txbox_lease WHERE shards = $1`),
		renew: r(`UPDATE {schema}.txbox_lease AS l SET expires_at = now() + $3 * interval '1 millisecond'
			FROM unnest($1::int[], $2::bigint[]) AS h(shard, token)
			WHERE l.shard = h.shard AND l.token = h.token
			RETURNING l.shard`),
		release: r(`UPDATE {schema}.txbox_lease SET owner = NULL, expires_at = '-infinity' WHERE shard = $1 AND token = $2`),
		// The fence: every state change locks the lease row first. A takeover either committed
		// before (the token differs: no row) or waits until this transaction ends.
		checkLease: r(`SELECT 1 FROM {schema}.txbox_lease WHERE shard = $1 AND token = $2 FOR UPDATE`),

		readMessages: r(readMessagesSQL(slots)),
		// The same read of one slot ($1 has one element), for a shard the look woke for one of its
		// slots (lease.next).
		readSlotMessages: r(readMessagesSQL(1)),
		dueSlots:         r(dueSlotsSQL),
		dueSlotsOrBalance: r(dueSlotsSQL + `
			UNION ALL
			SELECT -1 WHERE EXISTS (SELECT 1 FROM {schema}.txbox_lease WHERE shards = $2 AND expires_at <= now())
				OR (SELECT count(*) FROM {schema}.txbox_relay_node WHERE expires_at > now()) <> $3`),
		// Counts a refused publish of one message and sets its next attempt $3 ms from now.
		refuseMessage: r(`UPDATE {schema}.txbox_outbox
			SET attempts = attempts + 1, first_attempt_at = coalesce(first_attempt_at, now()), last_error = left($2, 4000),
				next_attempt_at = clock_timestamp() + $3 * interval '1 millisecond'
			WHERE id = $1 AND kind = 'message'
			RETURNING attempts`),
		deleteRows: r(`DELETE FROM {schema}.txbox_outbox WHERE id = ANY($1)`),
		// Deletes a row on its way to the dead-letter table, saying when it first failed.
		buryRow: r(`DELETE FROM {schema}.txbox_outbox WHERE id = $1 RETURNING first_attempt_at`),
		// Deletes the published rows: each where it was read, ctid $1[i], if it is still the row
		// read, id $2[i]. Found by its ctid, a row costs a heap fetch rather than a descent of the
		// primary key (half the buffers of a batch's delete); the id keeps a row that took the
		// place of one deleted meanwhile (by an operator's bury, then a vacuum) from being deleted
		// unpublished. A row updated meanwhile has moved and is not found: it stays pending and is
		// published again, a copy the inbox drops; the relay updates only rows it did not publish
		// (refuseMessage), so that takes an outside update or a rewrite of the table (VACUUM FULL).
		// Sent in the round trip that checks the lease (shard $3, token $4) before the check's
		// answer is in, it runs whether the check passed or not, so it carries the check too. Once
		// the check locked the lease row the token cannot change under it.
		completeMessages: r(`DELETE FROM {schema}.txbox_outbox AS o USING unnest($1::tid[], $2::bigint[]) AS d(tid, id)
			WHERE o.ctid = d.tid AND o.id = d.id
			  AND EXISTS (SELECT 1 FROM {schema}.txbox_lease WHERE shard = $3 AND token = $4)`),
		// The gauges' figures, bounded however deep the backlog (a Kafka outage at a few thousand
		// messages a second makes millions of rows, and every relay process asks every
		// StatsInterval): the backlog is counted up to $1 rows, and beyond that is PostgreSQL's
		// estimate of the table's rows (its density at the last VACUUM or ANALYZE, times the
		// table's current size), never less than $1; the oldest age is that of the oldest of the
		// first $2 rows by id. A row's id and created_at are both taken as it is written, so the
		// oldest row is among the first unless a transaction ran longer than it took to write $2
		// rows.
		stats: r(`SELECT CASE WHEN c.n < $1 THEN c.n ELSE greatest(c.n, e.estimate) END, o.age
			FROM (SELECT count(*) AS n FROM (SELECT FROM {schema}.txbox_outbox LIMIT $1) AS capped) AS c,
			     (SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS age
			      FROM (SELECT created_at FROM {schema}.txbox_outbox ORDER BY id LIMIT $2) AS head) AS o,
			     (SELECT CASE WHEN relpages > 0 AND reltuples > 0
			                  THEN reltuples / relpages * (pg_relation_size(oid) / current_setting('block_size')::bigint)
			                  ELSE 0 END::bigint AS estimate
			      FROM pg_catalog.pg_class WHERE oid = '{schema}.txbox_outbox'::regclass) AS e`),

		// Whether a call waits in any of the slots $1, for a relay that executes none: one probe of
		// the (kind, slot, id) index per slot.
		strandedCalls: r(`SELECT EXISTS (SELECT FROM {schema}.txbox_outbox WHERE kind = 'call' AND slot = ANY($1::smallint[]))`),

		// Due calls of the lease's slots. A call waits while an earlier call with its partition key
		// is pending, so calls on one key (charge, then refund) keep their order through retries.
		// The look is written as "the first of its key" so that it stays one probe of an index
		// (migration 00008) per row: as NOT EXISTS, PostgreSQL may plan it as an anti-join that
		// reads every call of the slot.
		readCalls: r(bySlot(`SELECT o.id, o.topic, o.partition_key, o.uuid, o.payload, o.metadata::text, o.idempotency_key
			FROM {schema}.txbox_outbox AS o
			WHERE o.kind = 'call' AND o.slot = {slot} AND o.next_attempt_at <= now()
			  AND o.id = (SELECT min(p.id) FROM {schema}.txbox_outbox AS p
				WHERE p.kind = 'call' AND p.slot = o.slot AND p.partition_key = o.partition_key)`, slots)),
		// Runs in the fenced transaction right before a send: the first attempt is recorded before
		// any byte leaves, and the age is measured by the database clock at this instant
		// (clock_timestamp, not the transaction's start). The age is the idempotency key's: from
		// the first attempt of any call with the key, pending or completed (and dead-lettered: see
		// dlq.Writer.CallFirstSent), since the provider forgets the key a fixed time after it first
		// saw it, whichever call sent it.
		startCall: r(`WITH c AS (
				UPDATE {schema}.txbox_outbox
				SET first_attempt_at = coalesce(first_attempt_at, now()), attempts = attempts + 1
				WHERE id = $1 AND kind = 'call'
				RETURNING attempts, first_attempt_at, idempotency_key)
			SELECT c.attempts, k.first, (extract(epoch FROM clock_timestamp() - k.first) * 1000)::bigint
			FROM c CROSS JOIN LATERAL (SELECT least(c.first_attempt_at,
				(SELECT min(p.first_attempt_at) FROM {schema}.txbox_outbox AS p WHERE p.kind = 'call' AND p.idempotency_key = c.idempotency_key),
				(SELECT r.first_attempt_at FROM {schema}.txbox_call_result AS r WHERE r.idempotency_key = c.idempotency_key)) AS first) AS k`),
		rescheduleCall: r(`UPDATE {schema}.txbox_outbox
			SET next_attempt_at = clock_timestamp() + $2 * interval '1 millisecond', last_error = left($3, 4000)
			WHERE id = $1`),
		// A key used by two calls (an explicit key written twice) keeps its first result: the second
		// call got the provider's replay of it.
		// A key's result is its first outcome the provider stored, so a call written again with
		// the key (the provider replays that outcome) keeps it. A rejection the provider does not
		// store: the next call with the key executes, and its outcome replaces the rejection. The
		// key's first attempt stays, for the replay window.
		insertCallResult: r(`INSERT INTO {schema}.txbox_call_result AS c
			(idempotency_key, call_uuid, outcome, http_status, object_id, body, attempts, duration_ms, first_attempt_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
			ON CONFLICT (idempotency_key) DO UPDATE SET outcome = excluded.outcome, http_status = excluded.http_status,
				object_id = excluded.object_id, body = excluded.body, attempts = excluded.attempts,
				duration_ms = excluded.duration_ms, completed_at = now()
			WHERE c.outcome = 'rejected'`),
	}
}

// readMessagesSQL reads the messages of the slots $1, which has slots elements.
//
// Pending means present: a row that commits late is read whenever it becomes visible. At
// most $2 rows, and only as many as fit in $3 bytes of payload and metadata, but always
// the first: a message larger than $3 goes alone. When $3 cuts the batch, the first row
// left out ends it, flagged "over" and without its payload and metadata, so the relay
// knows more rows are due. The cut is made on the rows read, so the read stays at $2
// rows, and the running sum streams: nothing is held back to count.
func readMessagesSQL(slots int) string {
	return `SELECT tid, id, topic, partition_key, uuid, CASE WHEN over THEN ''::bytea ELSE payload END,
				CASE WHEN over THEN '' ELSE metadata END, attempts, over
			FROM (SELECT b.*, b.n > 1 AND b.bytes > $3 AS over
				FROM (SELECT m.*, row_number() OVER w AS n, sum(m.size) OVER w AS bytes
					FROM (` + bySlot(`SELECT o.ctid AS tid, o.id, o.topic, o.partition_key, o.uuid, o.payload, o.metadata::text AS metadata, o.attempts,
							octet_length(o.payload) + octet_length(o.metadata::text) AS size
						FROM {schema}.txbox_outbox AS o
						WHERE o.kind = 'message' AND o.slot = {slot} AND `+messageDue, slots) + `) AS m
					WINDOW w AS (ORDER BY m.id)) AS b
				WHERE b.n = 1 OR b.bytes - b.size <= $3) AS c
			ORDER BY id`
}

// dueSlotsSQL finds which of the slots $1 have a message readMessages would return: one look into
// the index per slot, stopping at the first due row. dueSlotsOrBalance also answers -1 when the
// leases call for a balance: a lease of the layout $2 is free (released by a relay that stopped or
// gave up its extra shards), or the number of live relays is no longer $3.
var dueSlotsSQL = `SELECT s.slot FROM unnest($1::smallint[]) AS s(slot)
	WHERE EXISTS (SELECT 1 FROM {schema}.txbox_outbox AS o WHERE o.kind = 'message' AND o.slot = s.slot AND ` +
	strings.ReplaceAll(messageDue, "{slot}", "s.slot") + `)`

// messageDue says that message row o of slot {slot} is to be published now. A message the broker
// refused waits until its next attempt, and so does every later message of its partition key
// (messages without a key have no order to keep). Which keys of the slot wait is asked once per
// slot, not per row (an InitPlan where {slot} is a parameter): only a row of such a key looks for
// the earlier message it waits for.
const messageDue = `o.next_attempt_at <= now()
	AND (o.partition_key = ''
		OR o.partition_key <> ALL (coalesce((SELECT array_agg(h.partition_key) FROM {schema}.txbox_outbox AS h
			WHERE h.kind = 'message' AND h.attempts > 0 AND h.slot = {slot} AND h.next_attempt_at > now()), '{}'))
		OR NOT EXISTS (SELECT 1 FROM {schema}.txbox_outbox AS h
			WHERE h.kind = 'message' AND h.attempts > 0 AND h.slot = o.slot AND h.partition_key = o.partition_key
			  AND h.id < o.id AND h.next_attempt_at > now()))`

// bySlot turns read, a read of the one slot {slot} (its rows aliased o), into a read of the slots
// $1, which has slots elements, in id order and at most $2 rows: one range of the (kind, slot, id)
// index per slot, merged (a Merge Append), so a read touches about $2 rows plus one index descent
// per slot however large the backlog. The obvious "o.slot = ANY($1) ORDER BY o.id" walks the
// primary key instead and filters, passing every pending row of other shards on its way: an idle
// shard's read then costs the whole backlog.
func bySlot(read string, slots int) string {
	parts := make([]string, slots)
	for i := range parts {
		parts[i] = strings.ReplaceAll(read, "{slot}", fmt.Sprintf("($1::smallint[])[%d]", i+1)) + "\n\t\t\tORDER BY o.id LIMIT $2"
	}
	if slots == 1 {
		return parts[0] // A query of its own: UNION ALL's parentheses would make two ORDER BYs.
	}
	for i := range parts {
		parts[i] = "(" + parts[i] + ")"
	}
	return strings.Join(parts, "\nUNION ALL ") + "\nORDER BY id LIMIT $2"
}

// adminQueries are the statements of Admin.
type adminQueries struct {
	backlog, list, get, lockLeaseOf, deleteRow, callResults, leases, nodes string
}

// adminLayout is the shard layout an admin query groups rows by: $1, or when it is NULL the lease
// table's (the running relays'), or 16 when the table is empty.
const adminLayout = `WITH layout AS (SELECT coalesce($1::int, (SELECT max(shards) FROM {schema}.txbox_lease), 16) AS n) `

// rowColumns is the column list of the admin's row queries, in scanRow's order; {payload} is
// "payload", or "NULL::bytea" to leave it out.
const rowColumns = `id, kind, slot % layout.n, topic, partition_key, uuid, coalesce(idempotency_key, ''), metadata::text,
	{payload}, octet_length(payload), attempts, first_attempt_at,
	CASE WHEN next_attempt_at > now() THEN next_attempt_at END, coalesce(last_error, ''), created_at,
	(extract(epoch FROM now() - created_at) * 1000)::bigint`

func renderAdminQueries(schema string) adminQueries {
	r := func(s string) string { return sqlname.Render(s, schema) }
	columns := func(payload string) string { return strings.ReplaceAll(rowColumns, "{payload}", payload) }
	return adminQueries{
		// Every shard of the layout, empty ones included, with the relay that holds a live lease
		// on it.
		backlog: r(adminLayout + `
			SELECT s.shard, coalesce(b.messages, 0), coalesce(b.calls, 0), coalesce(b.failing, 0), coalesce(b.oldest_ms, 0),
				coalesce(l.owner, '')
			FROM layout CROSS JOIN generate_series(0, layout.n - 1) AS s(shard)
			LEFT JOIN (SELECT o.slot % layout.n AS shard,
					count(*) FILTER (WHERE o.kind = 'message') AS messages, count(*) FILTER (WHERE o.kind = 'call') AS calls,
					count(*) FILTER (WHERE o.last_error IS NOT NULL) AS failing,
					(extract(epoch FROM now() - min(o.created_at)) * 1000)::bigint AS oldest_ms
				FROM {schema}.txbox_outbox AS o CROSS JOIN layout GROUP BY 1) AS b ON b.shard = s.shard
			LEFT JOIN {schema}.txbox_lease AS l ON l.shard = s.shard AND l.shards = layout.n AND l.owner IS NOT NULL AND l.expires_at > now()
			ORDER BY s.shard`),
		// Filters, each NULL when open: $2 shards, $3 kind, $4 topic, $5 partition key, $6 failing
		// only, $7 older than (ms); then $8 the id to start after and $9 the limit.
		list: r(adminLayout + `SELECT ` + columns("NULL::bytea") + `
			FROM {schema}.txbox_outbox CROSS JOIN layout
			WHERE ($2::int[] IS NULL OR slot % layout.n = ANY($2))
			  AND ($3::text IS NULL OR kind = $3) AND ($4::text IS NULL OR topic = $4)
			  AND ($5::text IS NULL OR partition_key = $5) AND (NOT $6::bool OR last_error IS NOT NULL)
			  AND ($7::bigint IS NULL OR created_at <= now() - $7 * interval '1 millisecond')
			  AND id > $8
			ORDER BY id LIMIT $9`),
		get: r(adminLayout + `SELECT ` + columns("payload") + ` FROM {schema}.txbox_outbox CROSS JOIN layout WHERE id = $2`),
		// The lease row of the shard that outbox row $1 belongs to, in whatever layout the table
		// holds, locked as the relay's fenced transactions lock it.
		lockLeaseOf: r(`SELECT l.shard FROM {schema}.txbox_lease AS l JOIN {schema}.txbox_outbox AS o ON l.shard = o.slot % l.shards
			WHERE o.id = $1 FOR UPDATE OF l`),
		deleteRow: r(`DELETE FROM {schema}.txbox_outbox WHERE id = $1`),
		// Call results by idempotency key ($1) or provider object id ($2), each NULL when open,
		// only those not succeeded ($3), completed within $4 ms (NULL when open); $5 the limit.
		// The object id is indexed (migration 00007) for reconciliation from the provider's side.
		callResults: r(`SELECT idempotency_key, call_uuid, outcome, http_status, object_id, body, attempts, duration_ms,
				first_attempt_at, completed_at
			FROM {schema}.txbox_call_result
			WHERE ($1::text IS NULL OR idempotency_key = $1) AND ($2::text IS NULL OR object_id = $2)
			  AND (NOT $3::bool OR outcome <> 'succeeded')
			  AND ($4::bigint IS NULL OR completed_at > now() - $4 * interval '1 millisecond')
			ORDER BY completed_at DESC, idempotency_key LIMIT $5`),
		leases: r(`SELECT shard, shards, coalesce(owner, ''), token, CASE WHEN isfinite(expires_at) THEN expires_at END,
				expires_at <= now()
			FROM {schema}.txbox_lease ORDER BY shard`),
		nodes: r(`SELECT owner, expires_at, expires_at > now() AS live FROM {schema}.txbox_relay_node ORDER BY live DESC, owner`),
	}
}
