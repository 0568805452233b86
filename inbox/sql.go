package inbox

import (
	"github.com/txbox/txbox/internal/inboxgen"
	"github.com/txbox/txbox/internal/sqlname"
)

type queries struct {
	countAttempt, runAlone, endAttempt, deleteAttempts, lockGeneration, awaitGeneration, insertInbox, insertDead, flushStats string
}

func renderQueries(schema string) queries {
	return queries{
		countAttempt:    sqlname.Render(countAttemptSQL, schema),
		runAlone:        sqlname.Render(runAloneSQL, schema),
		endAttempt:      sqlname.Render(endAttemptSQL, schema),
		deleteAttempts:  sqlname.Render(deleteAttemptsSQL, schema),
		lockGeneration:  sqlname.Render(lockGenerationSQL, schema),
		awaitGeneration: sqlname.Render(awaitGenerationSQL, schema),
		insertInbox:     sqlname.Render(insertInboxSQL, schema),
		insertDead:      sqlname.Render(insertDeadSQL, schema),
		flushStats:      sqlname.Render(flushStatsSQL, schema),
	}
}

// Every statement but the generation lock's names a message's scope as $1 consumer, $2 dedup key, $3
// handler, and takes the bounds $4 and $5; its own parameters start at $6.
//
// A row with handler '' was written outside a router, or before deduplication was per handler
// (migration 00002): it settles the message for every handler of the consumer. Handler comes last
// in the primary key but for the generation, so looking for both rows reads one range of each
// generation's index, in the same statement: honouring old rows costs no round trip.

// bounds sets lock_timeout ($4) and idle_in_transaction_session_timeout ($5), in milliseconds, for
// the rest of the statement's transaction (a statement outside one is its own). Every statement
// that can wait on a lock another delivery holds reads its row from it, so the settings are in
// place before the wait and cost no round trip of their own.
const bounds = `(SELECT set_config('lock_timeout', $4, true), set_config('idle_in_transaction_session_timeout', $5, true)) AS bounds`

// notSettled is true unless a row of the message's handler, or a consumer-wide one (an empty
// handler), exists in any generation of the inbox: the primary key is per generation
// (migrations/00011_inbox_generations.sql), so it catches only what the current one holds.
const notSettled = `NOT EXISTS (
    SELECT 1 FROM {schema}.txbox_inbox WHERE consumer = $1 AND dedup_key = $2 AND handler IN ($3, ''))`

// asyncCommit lets the statement's transaction commit without waiting for its WAL to reach the disk.
// It is for the attempt counter's own transactions, whose commit would otherwise cost as much as the
// handler's. A crash of the consumer process loses nothing the server has committed; only a crash of
// PostgreSQL itself can lose the last few hundred milliseconds of such commits (wal_writer_delay),
// and then a counter is one attempt behind: a poison pill crashes its consumer once more. The
// handler's transaction commits synchronously, and flushes the counter's WAL written before it.
const asyncCommit = `(SELECT set_config('synchronous_commit', 'off', true)) AS async`

// countAttemptSQL writes the crash marker of a delivery before its handler runs: one more unfinished
// attempt. It returns the message's failed attempts, its last error and whether it is a crash suspect:
// an attempt before this one never ended (the process crashed, or another instance is processing
// it), or it ran alone last. It returns no row when the message already has an inbox row, and then
// writes nothing. It is sent in the round trip that opens the handler's transaction, in a
// transaction of its own before that one (Inbox.beginWithRow), so its answer comes with the
// transaction: a duplicate then ends the transaction unused.
const countAttemptSQL = `
INSERT INTO {schema}.txbox_inbox_attempt AS a (consumer, dedup_key, handler, attempts, unfinished)
SELECT $1, $2, $3, 0, 1
FROM ` + bounds + `, ` + asyncCommit + `
WHERE NOT EXISTS (SELECT 1 FROM {schema}.txbox_inbox WHERE consumer = $1 AND dedup_key = $2 AND handler IN ($3, ''))
ON CONFLICT (consumer, dedup_key, handler) DO UPDATE SET unfinished = a.unfinished + 1, last_at = now()
RETURNING attempts, last_error, unfinished > 1 OR alone OR suspected > 0`

// confirmed is a counter's failed attempts once a crash while it ran alone is known: the attempt that
// ran alone never ended, so the unfinished attempts set aside for that verdict are charged too.
const confirmed = `(a.attempts + CASE WHEN a.alone THEN a.suspected ELSE 0 END)`

// runAloneSQL starts a suspect's attempt, run while nothing else runs in its process, unless its
// failed attempts reached the limit $6. It sets aside the unfinished attempts (this delivery's own
// marker went before it waited to run alone: Inbox.handle). It returns the attempts, now including
// this one if it runs, the last error and whether it runs. It commits synchronously: it is the only
// record that the message ran alone.
const runAloneSQL = `
UPDATE {schema}.txbox_inbox_attempt AS a
SET attempts = ` + confirmed + ` + CASE WHEN ` + confirmed + ` < $6 THEN 1 ELSE 0 END,
    alone = ` + confirmed + ` < $6,
    suspected = CASE WHEN a.alone THEN 0 ELSE a.suspected END + a.unfinished,
    unfinished = 0,
    last_at = now()
FROM ` + bounds + `
WHERE a.consumer = $1 AND a.dedup_key = $2 AND a.handler = $3
RETURNING a.attempts, a.last_error, a.alone`

// endAttemptSQL records how an attempt that did not succeed ended: $6 says it ran alone, $7 that its
// failure was transient, $8 is its error (NULL when transient). An attempt that ran with others stops
// being unfinished and, unless transient, becomes a failed attempt. One that ran alone was counted
// when it started, and did not crash the process: a failure forgives the attempts suspected with
// it; a transient failure gives its own attempt back and leaves them to the next attempt alone.
const endAttemptSQL = `
UPDATE {schema}.txbox_inbox_attempt
SET unfinished = CASE WHEN $6 THEN unfinished ELSE greatest(unfinished - 1, 0) END,
    attempts = CASE WHEN $6 AND $7 THEN greatest(attempts - 1, 0)
                    WHEN NOT $6 AND NOT $7 THEN attempts + 1
                    ELSE attempts END,
    suspected = CASE WHEN $6 AND NOT $7 THEN 0 ELSE suspected END,
    alone = alone AND NOT $6,
    last_error = coalesce(left($8::text, 4000), last_error)
FROM ` + bounds + `, ` + asyncCommit + `
WHERE consumer = $1 AND dedup_key = $2 AND handler = $3`

const deleteAttemptsSQL = `
DELETE FROM {schema}.txbox_inbox_attempt
USING ` + bounds + `
WHERE consumer = $1 AND dedup_key = $2 AND handler = $3`

// lockGenerationSQL takes the generation lock (internal/inboxgen), the first statement of every
// transaction that inserts an inbox row. LOCK cannot set the bound of its own wait, and a bound per
// delivery written into its text would make every delivery's statement new to pgx's statement
// cache; so it does not wait: while a rotation holds the lock or waits for it, it fails at once,
// and the delivery waits for the rotation to end in a transaction of its own (lockTimeoutSQL, then
// awaitGenerationSQL) and begins again.
const lockGenerationSQL = inboxgen.DeliveryLock + ` NOWAIT`

const (
	lockTimeoutSQL     = `SELECT set_config('lock_timeout', $1, true)`
	awaitGenerationSQL = inboxgen.DeliveryLock
)

// insertInboxSQL also deletes the message's attempt counter: the transaction commits only if the
// handler succeeded, and then the counter is settled. Deleting it here rather than after the
// handler saves a round trip. A row goes into the current generation; ON CONFLICT waits for a
// concurrent delivery's row there, and notSettled finds committed rows in older ones.
const insertInboxSQL = `
WITH b AS MATERIALIZED (SELECT * FROM ` + bounds + `),
cleared AS (DELETE FROM {schema}.txbox_inbox_attempt USING b WHERE consumer = $1 AND dedup_key = $2 AND handler = $3)
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, lease_shard, lease_token, generation)
SELECT $1, $2, $3, $6::text, $7::text, $8::integer, $9::bigint, g.generation
FROM b, {schema}.txbox_inbox_generation AS g
WHERE ` + notSettled + `
ON CONFLICT (consumer, dedup_key, handler, generation) DO NOTHING`

const insertDeadSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state, generation)
SELECT $1, $2, $3, $6::text, $7::text, 'dead', g.generation
FROM ` + bounds + `, {schema}.txbox_inbox_generation AS g
WHERE ` + notSettled + `
ON CONFLICT (consumer, dedup_key, handler, generation) DO NOTHING`

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
