package relay

import "github.com/txbox/txbox/internal/sqlname"

// setIdleTimeout bounds, for the rest of a fenced transaction, how long the session may sit idle
// in it before PostgreSQL ends the session ($1 in milliseconds).
const setIdleTimeout = `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`

type queries struct {
	lockLeases, liveOtherLayout, dropOtherLayout, createLeases,
	heartbeat, forgetNode, liveNodes, pruneNodes,
	acquire, renew, release, checkLease,
	readMessages, deleteRows, stats string

	readCalls, startCall, rescheduleCall, insertCallResult string
}

func renderQueries(schema string) queries {
	r := func(s string) string { return sqlname.Render(s, schema) }
	return queries{
		lockLeases:      r(`LOCK TABLE {schema}.txbox_lease IN EXCLUSIVE MODE`),
		liveOtherLayout: r(`SELECT shards FROM {schema}.txbox_lease WHERE shards <> $1 AND owner IS NOT NULL AND expires_at > now() LIMIT 1`),
		dropOtherLayout: r(`DELETE FROM {schema}.txbox_lease WHERE shards <> $1`),
		createLeases: r(`INSERT INTO {schema}.txbox_lease (shard, shards)
			SELECT s, $1 FROM generate_series(0, $1 - 1) AS s ON CONFLICT (shard) DO NOTHING`),

		heartbeat: r(`INSERT INTO {schema}.txbox_relay_node (owner, expires_at) VALUES ($1, now() + $2 * interval '1 millisecond')
			ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at`),
		forgetNode: r(`DELETE FROM {schema}.txbox_relay_node WHERE owner = $1`),
		liveNodes:  r(`SELECT count(*) FROM {schema}.txbox_relay_node WHERE expires_at > now()`),
		pruneNodes: r(`DELETE FROM {schema}.txbox_relay_node WHERE expires_at < now() - interval '1 hour'`),

		// Only a free or expired lease is taken, by the database's clock; the token comes from a
		// sequence, so it is new even for the same owner.
		acquire: r(`UPDATE {schema}.txbox_lease SET owner = $1, token = nextval('{schema}.txbox_lease_token'),
				expires_at = now() + $2 * interval '1 millisecond'
			WHERE shard IN (SELECT shard FROM {schema}.txbox_lease
				WHERE shards = $3 AND expires_at <= now() ORDER BY shard LIMIT $4 FOR UPDATE SKIP LOCKED)
			RETURNING shard, token`),
		renew: r(`UPDATE {schema}.txbox_lease AS l SET expires_at = now() + $3 * interval '1 millisecond'
			FROM unnest($1::int[], $2::bigint[]) AS h(shard, token)
			WHERE l.shard = h.shard AND l.token = h.token
			RETURNING l.shard`),
		release: r(`UPDATE {schema}.txbox_lease SET owner = NULL, expires_at = '-infinity' WHERE shard = $1 AND token = $2`),
		// The fence: every state change locks the lease row first. A takeover either committed
		// before (the token differs: no row) or waits until this transaction ends.
		checkLease: r(`SELECT 1 FROM {schema}.txbox_lease WHERE shard = $1 AND token = $2 FOR UPDATE`),

		// Pending means present: a row that commits late is read whenever it becomes visible.
		readMessages: r(`SELECT id, topic, partition_key, uuid, payload, metadata::text
			FROM {schema}.txbox_outbox WHERE kind = 'message' AND slot = ANY($1) ORDER BY id LIMIT $2`),
		deleteRows: r(`DELETE FROM {schema}.txbox_outbox WHERE id = ANY($1)`),
		stats:      r(`SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM {schema}.txbox_outbox`),

		// Due calls of the lease's slots. A call waits while an earlier call with its partition key
		// is pending, so calls on one key (charge, then refund) keep their order through retries.
		readCalls: r(`SELECT o.id, o.topic, o.partition_key, o.uuid, o.payload, o.metadata::text, o.idempotency_key
			FROM {schema}.txbox_outbox AS o
			WHERE o.kind = 'call' AND o.slot = ANY($1) AND o.next_attempt_at <= now()
			  AND NOT EXISTS (SELECT 1 FROM {schema}.txbox_outbox AS p
				WHERE p.kind = 'call' AND p.slot = o.slot AND p.partition_key = o.partition_key AND p.id < o.id)
			ORDER BY o.id LIMIT $2`),
		// Runs in the fenced transaction right before a send: the first attempt is recorded before
		// any byte leaves, and the age is measured by the database clock at this instant
		// (clock_timestamp, not the transaction's start).
		startCall: r(`UPDATE {schema}.txbox_outbox
			SET first_attempt_at = coalesce(first_attempt_at, now()), attempts = attempts + 1
			WHERE id = $1 AND kind = 'call'
			RETURNING attempts, first_attempt_at, (extract(epoch FROM clock_timestamp() - first_attempt_at) * 1000)::bigint`),
		rescheduleCall: r(`UPDATE {schema}.txbox_outbox
			SET next_attempt_at = clock_timestamp() + $2 * interval '1 millisecond', last_error = left($3, 4000)
			WHERE id = $1`),
		// A key used by two calls (an explicit key written twice) keeps its first result: the second
		// call got the provider's replay of it.
		insertCallResult: r(`INSERT INTO {schema}.txbox_call_result
			(idempotency_key, call_uuid, outcome, http_status, object_id, body, attempts, duration_ms)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
			ON CONFLICT (idempotency_key) DO NOTHING`),
	}
}

// Reports for operators (status.go): read-only, by the database clock.
const (
	leasesSQL = `SELECT shard, shards, coalesce(owner, ''), token, CASE WHEN isfinite(expires_at) THEN expires_at END, expires_at <= now()
		FROM {schema}.txbox_lease ORDER BY shard`
	nodesSQL = `SELECT owner, expires_at, expires_at > now() AS live
		FROM {schema}.txbox_relay_node ORDER BY live DESC, owner`
	failingCallsSQL = `SELECT id, idempotency_key, coalesce(convert_from(payload, 'UTF8')::jsonb->>'name', ''), attempts,
			coalesce(first_attempt_at, created_at), greatest(next_attempt_at, now()), last_error
		FROM {schema}.txbox_outbox WHERE kind = 'call' AND last_error IS NOT NULL
		ORDER BY first_attempt_at NULLS LAST, id LIMIT $1`
	unsuccessfulCallsSQL = `SELECT idempotency_key, outcome, http_status, object_id, attempts, completed_at
		FROM {schema}.txbox_call_result
		WHERE outcome <> 'succeeded' AND completed_at > now() - $1 * interval '1 millisecond'
		ORDER BY completed_at DESC LIMIT $2`
	backlogSQL = `WITH layout AS (SELECT coalesce(max(shards), $1) AS n FROM {schema}.txbox_lease)
		SELECT o.slot % layout.n, count(*) FILTER (WHERE o.kind = 'message'), count(*) FILTER (WHERE o.kind = 'call'),
			extract(epoch FROM now() - min(o.created_at))::float8
		FROM {schema}.txbox_outbox AS o, layout GROUP BY 1 ORDER BY 1`
)
