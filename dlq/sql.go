package dlq

const insertSQL = `
INSERT INTO {schema}.txbox_dlq
    (source, kind, topic, consumer, dedup_key, partition_key, uuid, payload, metadata, idempotency_key, reason, error, attempts, handler, first_failed_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12, $13, $14, coalesce($15::timestamptz, now()))`

// callFirstSentSQL is the first attempt of the earliest call letter with the idempotency key $1
// that was sent (a letter of a call never sent has no attempts, and its first_failed_at is when it
// was buried).
const callFirstSentSQL = `
SELECT min(first_failed_at) FROM {schema}.txbox_dlq WHERE kind = 'call' AND idempotency_key = $1 AND attempts > 0`

const statsSQL = `
SELECT count(*) FILTER (WHERE source = 'inbox'),
       coalesce(extract(epoch FROM now() - min(first_failed_at) FILTER (WHERE source = 'inbox')), 0)::float8,
       count(*) FILTER (WHERE source = 'relay'),
       coalesce(extract(epoch FROM now() - min(first_failed_at) FILTER (WHERE source = 'relay')), 0)::float8
FROM {schema}.txbox_dlq`

// letterColumns is the column list every query that returns whole letters selects, in scanLetter's
// order.
const letterColumns = `id, source, kind, topic, consumer, handler, dedup_key, partition_key, uuid, payload, metadata::text,
    coalesce(idempotency_key, ''), reason, error, attempts, first_failed_at, last_failed_at`

// filterSQL is the WHERE clause of a Filter. Every condition is a parameter that is NULL when the
// filter leaves it open, so the statement text never depends on caller input. Ages are measured
// from $8, or from now() when it is NULL.
//
// Parameters: $1 source, $2 kind, $3 topic, $4 consumer, $5 reason substring, $6 older-than and $7
// younger-than in microseconds, $8 reference time, $9 ids; then $10 and $11 bound the ids
// (id > $10, id <= $11) and $12 is the limit (NULL: none, as LIMIT NULL is LIMIT ALL); $13 is the
// handler.
const filterSQL = `
    ($1::text IS NULL OR source = $1)
    AND ($2::text IS NULL OR kind = $2)
    AND ($3::text IS NULL OR topic = $3)
    AND ($4::text IS NULL OR consumer = $4)
    AND ($13::text IS NULL OR handler = $13)
    AND ($5::text IS NULL OR strpos(lower(reason), lower($5)) > 0)
    AND ($6::bigint IS NULL OR first_failed_at <= coalesce($8::timestamptz, now()) - $6 * interval '1 microsecond')
    AND ($7::bigint IS NULL OR first_failed_at > coalesce($8::timestamptz, now()) - $7 * interval '1 microsecond')
    AND ($9::bigint[] IS NULL OR id = ANY($9))`

// openWindowSQL leaves the id bounds optional, for one-shot statements.
const openWindowSQL = `
    AND ($10::bigint IS NULL OR id > $10)
    AND ($11::bigint IS NULL OR id <= $11)`

const listSQL = `
SELECT ` + letterColumns + `
FROM {schema}.txbox_dlq
WHERE ` + filterSQL + openWindowSQL + `
ORDER BY id
LIMIT $12`

const getSQL = `
SELECT ` + letterColumns + `
FROM {schema}.txbox_dlq
WHERE id = $1`

const countSQL = `
SELECT count(*) FROM (
    SELECT id FROM {schema}.txbox_dlq WHERE ` + filterSQL + openWindowSQL + ` ORDER BY id LIMIT $12
) AS s`

// maxIDSQL is the highest id of the letters committed so far (a letter whose transaction is
// still open may commit with a lower one).
const maxIDSQL = `SELECT coalesce(max(id), 0) FROM {schema}.txbox_dlq`

const discardSQL = `
DELETE FROM {schema}.txbox_dlq
WHERE id IN (SELECT id FROM {schema}.txbox_dlq WHERE ` + filterSQL + openWindowSQL + ` ORDER BY id LIMIT $12)`

// planSQL sizes a redrive before it starts: the letters per topic, kind, whether their message
// has an id the outbox takes (one of at most $15 bytes) and whether its payload is over the
// outbox's limit ($14), with the first few ids of
// each group for error messages, the highest id, and the reference time the redrive's ages are
// measured from.
const planSQL = `
SELECT topic, kind, no_id, too_large, count(*), (array_agg(id ORDER BY id))[1:10], max(id), now()
FROM (
    SELECT id, topic, kind, uuid = '' OR octet_length(uuid) > $15 AS no_id, octet_length(payload) > $14 AS too_large
    FROM {schema}.txbox_dlq WHERE ` + filterSQL + openWindowSQL + ` ORDER BY id LIMIT $12
) AS s
GROUP BY topic, kind, no_id, too_large
ORDER BY min(id)`

// lockBatchSQL takes the next batch of a redrive. The plan fixed the reference time $8 and the
// highest id $11, so the selection cannot grow while the redrive runs: a message that fails again
// on its way back must wait for the next run, not circle for ever. "id + 0" keeps that bound out
// of the index condition: as a range on both sides its estimate is tiny, and on a freshly filled
// table without statistics the planner then collects and sorts every remaining letter for each
// batch; as a filter, each batch walks the primary key from the cursor $10 and stops. SKIP LOCKED: a letter another redrive holds is that redrive's to move, never ours too;
// LIMIT applies after locking, so skipped rows do not shorten the batch.
const lockBatchSQL = `
SELECT ` + letterColumns + `
FROM {schema}.txbox_dlq
WHERE id > $10 AND id + 0 <= $11 AND ` + filterSQL + `
ORDER BY id
LIMIT $12
FOR UPDATE SKIP LOCKED`

// releaseDeadSQL deletes the 'dead' inbox rows of redriven letters so their consumers' handlers
// process the messages again: exactly the row of the letter's consumer, handler and dedup key.
// Only 'dead': a 'done' row means the handler processed the message, and the redriven copy must
// stay a duplicate for it.
const releaseDeadSQL = `
DELETE FROM {schema}.txbox_inbox AS i
USING unnest($1::text[], $2::text[], $3::text[]) AS k(consumer, handler, dedup_key)
WHERE i.consumer = k.consumer AND i.dedup_key = k.dedup_key AND i.handler = k.handler AND i.state = 'dead'`

// recordRedriveSQL notes when messages ($1 UUIDs, $2 topics) were redriven, so that retention keeps
// the inbox rows other consumers have of them (see package retention). One message may come from
// several consumers' letters in one batch, hence DISTINCT.
const recordRedriveSQL = `
INSERT INTO {schema}.txbox_redrive (message_uuid, topic)
SELECT DISTINCT m.uuid, m.topic FROM unnest($1::text[], $2::text[]) AS m(uuid, topic)
ON CONFLICT (message_uuid, topic) DO UPDATE SET redriven_at = now()`

const deleteLettersSQL = `DELETE FROM {schema}.txbox_dlq WHERE id = ANY($1)`
