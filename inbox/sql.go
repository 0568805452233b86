package inbox

import "github.com/txbox/txbox/internal/sqlname"

type queries struct {
	countAttempt, endAttempt, deleteAttempts, insertInbox, insertDead, flushStats string
}

func renderQueries(schema string) queries {
	return queries{
		countAttempt:   sqlname.Render(countAttemptSQL, schema),
		endAttempt:     sqlname.Render(endAttemptSQL, schema),
		deleteAttempts: sqlname.Render(deleteAttemptsSQL, schema),
		insertInbox:    sqlname.Render(insertInboxSQL, schema),
		insertDead:     sqlname.Render(insertDeadSQL, schema),
		flushStats:     sqlname.Render(flushStatsSQL, schema),
	}
}

// Every statement names a message's scope as $1 consumer, $2 dedup key, $3 handler, and takes the
// bounds $4 and $5; its own parameters start at $6.
//
// A row with handler '' was written outside a router, or before deduplication was per handler
// (migration 00002): it settles the message for every handler of the consumer. Handler comes last
// in the primary key, so looking for both rows reads one range of the same index, in the same
// statement: honouring old rows costs no round trip.

// bounds sets lock_timeout ($4) and idle_in_transaction_session_timeout ($5), in milliseconds, for
// the rest of the statement's transaction (a statement outside one is its own). Every statement
// that can wait on a lock another delivery holds reads its row from it, so the settings are in
// place before the wait and cost no round trip of their own.
const bounds = `(SELECT set_config('lock_timeout', $4, true), set_config('idle_in_transaction_session_timeout', $5, true)) AS bounds`

// noConsumerWideRow is true unless a consumer-wide row (one with an empty handler) settled the
// message.
const noConsumerWideRow = `($3::text = '' OR NOT EXISTS (
    SELECT 1 FROM {schema}.txbox_inbox WHERE consumer = $1 AND dedup_key = $2 AND handler = ''))`

// countAttemptSQL returns no row when the message already has an inbox row: the cheap path for
// duplicates, taken without opening the handler's transaction.
const countAttemptSQL = `
INSERT INTO {schema}.txbox_inbox_attempt AS a (consumer, dedup_key, handler, attempts)
SELECT $1, $2, $3, 1
FROM ` + bounds + `
WHERE NOT EXISTS (SELECT 1 FROM {schema}.txbox_inbox WHERE consumer = $1 AND dedup_key = $2 AND handler IN ($3, ''))
ON CONFLICT (consumer, dedup_key, handler) DO UPDATE SET attempts = a.attempts + 1, last_at = now()
RETURNING attempts, last_error`

// endAttemptSQL gives back $6 attempts (1 after a transient failure, else 0) and records the last
// error $7 when it is not NULL.
const endAttemptSQL = `
UPDATE {schema}.txbox_inbox_attempt
SET attempts = greatest(attempts - $6::integer, 0), last_error = coalesce(left($7::text, 4000), last_error)
FROM ` + bounds + `
WHERE consumer = $1 AND dedup_key = $2 AND handler = $3`

const deleteAttemptsSQL = `
DELETE FROM {schema}.txbox_inbox_attempt
USING ` + bounds + `
WHERE consumer = $1 AND dedup_key = $2 AND handler = $3`

// insertInboxSQL also sets the bounds for the handler's transaction, which it opens.
const insertInboxSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, lease_shard, lease_token)
SELECT $1, $2, $3, $6::text, $7::text, $8::integer, $9::bigint
FROM ` + bounds + `
WHERE ` + noConsumerWideRow + `
ON CONFLICT (consumer, dedup_key, handler) DO NOTHING`

const insertDeadSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state)
SELECT $1, $2, $3, $6::text, $7::text, 'dead'
FROM ` + bounds + `
WHERE ` + noConsumerWideRow + `
ON CONFLICT (consumer, dedup_key, handler) DO NOTHING`

// flushStatsSQL adds consumer $1's dedup counts (handlers $2, checks $3, hits $4) to the current
// minute's buckets, by the database clock, and deletes buckets older than a week: the index on
// minute makes that an empty range scan almost every time.
const flushStatsSQL = `
WITH pruned AS (DELETE FROM {schema}.txbox_dedup_stats WHERE minute < now() - interval '7 days')
INSERT INTO {schema}.txbox_dedup_stats AS s (minute, consumer, handler, checks, hits)
SELECT date_trunc('minute', now()), $1, h.handler, h.checks, h.hits
FROM unnest($2::text[], $3::bigint[], $4::bigint[]) AS h(handler, checks, hits)
ON CONFLICT (minute, consumer, handler) DO UPDATE
SET checks = s.checks + excluded.checks, hits = s.hits + excluded.hits, updated_at = now()`

// dedupStatsSQL sums the buckets of the minutes that overlap the last $1 milliseconds.
const dedupStatsSQL = `
SELECT consumer, handler, sum(checks)::bigint, sum(hits)::bigint, min(minute), max(updated_at)
FROM {schema}.txbox_dedup_stats
WHERE minute >= date_trunc('minute', now() - $1 * interval '1 millisecond')
GROUP BY consumer, handler
ORDER BY consumer, handler`
