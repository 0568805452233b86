package retention

import (
	"strconv"

	"github.com/txbox/txbox/internal/inboxgen"
	"github.com/txbox/txbox/internal/sqlname"
)

type queries struct {
	cutoffs, keepRedriven, deleteDone, deleteDead, deleteAttempts, deleteRedrives, deleteCallResults string

	lockGenerationRow, lockGenerations, lockEarlierDeliveries, newGeneration, generations,
	pendingDetaches, detachedTables, newestInGeneration, recentRedrives, moveDead, moveRedriven string
}

func renderQueries(schema string) queries {
	r := func(s string) string { return sqlname.Render(s, schema) }
	return queries{
		lockGenerationRow:     r(lockGenerationRowSQL),
		lockGenerations:       r(lockGenerationsSQL),
		lockEarlierDeliveries: r(inboxgen.EarlierDeliveriesLock),
		newGeneration:         r(newGenerationSQL),
		generations:           r(generationsSQL),
		pendingDetaches:       r(pendingDetachesSQL),
		detachedTables:        r(detachedTablesSQL),
		newestInGeneration:    r(newestInGenerationSQL),
		recentRedrives:        r(recentRedrivesSQL),
		moveDead:              r(moveDeadSQL),
		moveRedriven:          r(moveRedrivenSQL),
		cutoffs:               r(cutoffsSQL),
		keepRedriven:          r(keepRedrivenSQL),
		deleteRedrives:        r(deleteRedrivesSQL),
		deleteDone:            r(deleteDoneSQL),
		deleteDead:            r(deleteDeadSQL),
		deleteAttempts:        r(deleteAttemptsSQL),
		deleteCallResults:     r(deleteCallResultsSQL),
	}
}

// cutoffsSQL computes a pass's cutoffs by the database's clock, from the retentions in
// microseconds ($1 inbox, $2 call results). The 'done' cutoff is also measured back from the
// oldest letter still in the DLQ that consumers may have seen (see the package documentation for
// why): an inbox letter, or the letter of a message an operator buried (relay.ReasonBuried),
// which may have been published as it was buried, or the letter of a redriven message the broker
// refused, whose original consumers processed. The relay's other letters are of messages the
// broker refused, which no consumer saw.
const cutoffsSQL = `
SELECT now(),
       least(now(), coalesce(d.oldest, now())) - $1 * interval '1 microsecond',
       now() - $1 * interval '1 microsecond',
       now() - $2 * interval '1 microsecond',
       d.oldest
FROM (SELECT least(
    (SELECT min(first_failed_at) FROM {schema}.txbox_dlq WHERE source = 'inbox'),
    (SELECT min(first_failed_at) FROM {schema}.txbox_dlq WHERE source = 'relay' AND kind = 'message'
        AND (reason = 'buried by operator' OR (uuid, topic) IN (SELECT message_uuid, topic FROM {schema}.txbox_redrive)))
) AS oldest) AS d`

// Inbox generations (migrations/00011_inbox_generations.sql, the package documentation).
// Partitions are named generationPrefix and their generation, and made and dropped by statements
// built in Go around the quoted schema: DDL takes no parameters.
const generationPrefix = "txbox_inbox_g"

// newGenerationDDL makes generation's partition and attaches it. ATTACH locks the inbox only in SHARE
// UPDATE EXCLUSIVE mode, which deliveries' inserts do not conflict with (CREATE TABLE ... PARTITION
// OF would lock it exclusively); the partition is empty, so proving its constraint reads nothing.
func newGenerationDDL(schema, table string, generation int64) []string {
	return []string{
		`CREATE TABLE ` + table + ` (LIKE ` + schema + `.txbox_inbox INCLUDING CONSTRAINTS)`,
		`ALTER TABLE ` + schema + `.txbox_inbox ATTACH PARTITION ` + table + ` FOR VALUES IN (` + strconv.FormatInt(generation, 10) + `)`,
	}
}

func detachDDL(schema, table string) string {
	return `ALTER TABLE ` + schema + `.txbox_inbox DETACH PARTITION ` + table + ` CONCURRENTLY`
}

func finalizeDetachDDL(schema, table string) string {
	return `ALTER TABLE ` + schema + `.txbox_inbox DETACH PARTITION ` + table + ` FINALIZE`
}

func dropDDL(table string) string { return `DROP TABLE ` + table }

// lockGenerationRowSQL locks the control row for a rotation, so Cleaners rotate one at a time, sets
// lock_timeout ($2, in milliseconds) for the rest of the transaction and says whether the current
// generation is due: it became current at least $1 microseconds ago.
const lockGenerationRowSQL = `
SELECT g.generation, g.started_at <= now() - $1 * interval '1 microsecond'
FROM {schema}.txbox_inbox_generation AS g, (SELECT set_config('lock_timeout', $2, true)) AS bounds
FOR UPDATE OF g`

// lockGenerationsSQL waits until no transaction inserts an inbox row any more, and keeps new ones
// from starting until the rotation commits (internal/inboxgen); lock_timeout bounds both. The
// rotation then does the same for deliveries of earlier versions (inboxgen.EarlierDeliveriesLock).
const lockGenerationsSQL = inboxgen.RotationLock

const newGenerationSQL = `UPDATE {schema}.txbox_inbox_generation SET generation = $1, started_at = now()`

// generationsSQL lists the generations attached to the inbox, oldest first, and the current one.
const generationsSQL = `
SELECT substr(c.relname, length('` + generationPrefix + `') + 1)::bigint AS generation, g.generation
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
CROSS JOIN {schema}.txbox_inbox_generation AS g
WHERE i.inhparent = '{schema}.txbox_inbox'::regclass AND NOT i.inhdetachpending
  AND c.relname ~ '^` + generationPrefix + `[0-9]+$'
ORDER BY 1`

// pendingDetachesSQL lists the generations whose concurrent detach was interrupted: retention
// finishes it.
const pendingDetachesSQL = `
SELECT c.relname
FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = '{schema}.txbox_inbox'::regclass AND i.inhdetachpending`

// detachedTablesSQL lists the generations detached but not yet dropped: a table of generations
// is never anything else, since a rotation makes it and attaches it in one transaction.
const detachedTablesSQL = `
SELECT relname FROM pg_class
WHERE relnamespace = '{schema}'::regnamespace AND relkind = 'r' AND NOT relispartition
  AND relname ~ '^` + generationPrefix + `[0-9]+$'`

// newestInGenerationSQL reads the receipt time of generation $1's newest row from its index; NULL
// when it is empty.
const newestInGenerationSQL = `SELECT max(received_at) FROM {schema}.txbox_inbox WHERE generation = $1`

// A redrive record ($1 the cutoff) keeps the inbox rows of its message when the redrive came
// after the cutoff, or while a letter of the message waits in the DLQ: the letter of a copy that
// failed again holds the 'done' cutoff back only from the rows received within the broker's
// retention before it, not from the rows of consumers that processed the message before the
// redrive, and its own redrive will send those consumers another copy. As IN rather than a
// correlated EXISTS, the DLQ is read once per statement, into a hash.
const redriveKeepsSQL = `(r.redriven_at >= $1 OR (r.message_uuid, r.topic) IN (SELECT d.uuid, d.topic FROM {schema}.txbox_dlq AS d WHERE d.kind = 'message'))`

// recentRedrivesSQL says whether a redrive record keeps rows (redriveKeepsSQL); without one, no
// generation needs the scan that moveRedrivenSQL makes.
const recentRedrivesSQL = `SELECT EXISTS (SELECT 1 FROM {schema}.txbox_redrive AS r WHERE ` + redriveKeepsSQL + `)`

// Before a generation ($1) is dropped, the rows that must stay move to the current generation; the
// old row stays until the drop, and ON CONFLICT makes a repeated move (after a failed pass) a no-op.

// moveDeadSQL moves the 'dead' rows whose letter is still in the DLQ, found from the letters by
// the primary key. It locks the letters: a redrive that holds one first has deleted the row with
// the letter when the move sees it again, and one that comes after the move deletes the moved row
// too; a redrive skips a letter the move holds (dlq's SKIP LOCKED), and leaves it in the DLQ.
const moveDeadSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state, lease_shard, lease_token, received_at, generation)
SELECT i.consumer, i.dedup_key, i.handler, i.message_uuid, i.topic, i.state, i.lease_shard, i.lease_token, i.received_at, g.generation
FROM {schema}.txbox_dlq AS d
JOIN {schema}.txbox_inbox AS i
  ON i.consumer = d.consumer AND i.dedup_key = d.dedup_key AND i.handler = d.handler AND i.generation = $1
CROSS JOIN {schema}.txbox_inbox_generation AS g
WHERE d.source = 'inbox' AND i.state = 'dead'
FOR KEY SHARE OF d
ON CONFLICT (consumer, dedup_key, handler, generation) DO NOTHING`

// moveRedrivenSQL moves the rows of generation $2 that a redrive record keeps (redriveKeepsSQL,
// cutoff $1), with their receipt time moved forward to the redrive, as keepRedrivenSQL does for a
// row it keeps. There is no index by message UUID (see keepRedrivenSQL), so it scans the
// generation, once, and only when such a record exists (recentRedrivesSQL). A message redriven
// after the pass read its cutoffs is not in a generation the pass drops (the package
// documentation).
const moveRedrivenSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state, lease_shard, lease_token, received_at, generation)
SELECT i.consumer, i.dedup_key, i.handler, i.message_uuid, i.topic, i.state, i.lease_shard, i.lease_token,
       greatest(i.received_at, r.redriven_at), g.generation
FROM {schema}.txbox_inbox AS i
JOIN {schema}.txbox_redrive AS r ON r.message_uuid = i.message_uuid AND r.topic = i.topic
CROSS JOIN {schema}.txbox_inbox_generation AS g
WHERE i.generation = $2 AND ` + redriveKeepsSQL + `
ON CONFLICT (consumer, dedup_key, handler, generation) DO NOTHING`

// Inbox rows past the cutoff are deleted one by one only in the current generation, the only one
// that cannot be dropped and whose space new rows reuse: the generation from before the inbox had
// generations while it is still current, and rows moved in whose reason went since. An older
// generation takes no insert, so deleting its rows one by one would reclaim nothing before the drop
// and leave as many dead tuples for VACUUM; its rows all go once its newest one is past the cutoff,
// at most a generation later. These statements name the current generation's table
// ({generation}, filled in by Cleaner.inGeneration) rather than filter the inbox by generation:
// the table's own received_at index finds the due rows, where a filter on the generation, which
// every row of the partition matches, can lead the planner to read all of it through its primary
// key (as it did on a partition without statistics). Should another Cleaner rotate meanwhile, a
// pass deletes from a generation just made old: harmless, the rows are due.
//
// Each delete takes one batch: it picks at most $2 rows by ctid, skipping rows another session has
// locked, and deletes them in one short statement. The conditions are repeated outside the
// subquery: should a row change between the two, PostgreSQL rechecks them on its newest version.
const generationPlaceholder = "{generation}"

// keepRedrivenSQL gives the current generation's inbox rows received before the cutoff $1 the
// time of the redrive of their message as their receipt time, when a redrive record keeps them
// (redriveKeepsSQL) and the redrive came after their receipt: the redriven copy can still be
// delivered, or a letter of it redriven again, so every consumer that has a row for the message
// must keep it (package doc). A row moved to a redrive before the cutoff, for a letter of the
// message that waits, stays due but is not moved again: that letter holds the 'done' cutoff back
// from it. It touches only rows that are due, so each pass reads what it is about to delete
// anyway. The rows of an older generation stay where they are until it is dropped, and move out of
// it then (moveRedrivenSQL): nothing deletes them before.
const keepRedrivenSQL = `
WITH due AS (
    DELETE FROM {generation} AS i
    USING {schema}.txbox_redrive AS r
    WHERE i.ctid = ANY(ARRAY(
            SELECT i.ctid FROM {generation} AS i
            JOIN {schema}.txbox_redrive AS r ON r.message_uuid = i.message_uuid AND r.topic = i.topic
            WHERE i.received_at < $1 AND i.received_at < r.redriven_at AND ` + redriveKeepsSQL + `
            LIMIT $2
            FOR UPDATE OF i SKIP LOCKED))
      AND r.message_uuid = i.message_uuid AND r.topic = i.topic
      AND i.received_at < $1 AND i.received_at < r.redriven_at AND ` + redriveKeepsSQL + `
    RETURNING i.consumer, i.dedup_key, i.handler, i.message_uuid, i.topic, i.state, i.lease_shard, i.lease_token, r.redriven_at
)
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state, lease_shard, lease_token, received_at, generation)
SELECT d.consumer, d.dedup_key, d.handler, d.message_uuid, d.topic, d.state, d.lease_shard, d.lease_token, d.redriven_at, g.generation
FROM due AS d CROSS JOIN {schema}.txbox_inbox_generation AS g
ON CONFLICT (consumer, dedup_key, handler, generation) DO NOTHING`

// deleteRedrivesSQL forgets the redrives that keep no inbox row any more (redriveKeepsSQL).
const deleteRedrivesSQL = `
DELETE FROM {schema}.txbox_redrive AS r
WHERE ctid = ANY(ARRAY(
        SELECT r.ctid FROM {schema}.txbox_redrive AS r
        WHERE NOT ` + redriveKeepsSQL + `
        LIMIT $2
        FOR UPDATE SKIP LOCKED))
  AND NOT ` + redriveKeepsSQL

const deleteDoneSQL = `
DELETE FROM {generation}
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {generation}
        WHERE state = 'done' AND received_at < $1
        LIMIT $2
        FOR UPDATE SKIP LOCKED))
  AND state = 'done' AND received_at < $1`

// A 'dead' row whose letter is still in the DLQ is what keeps the broker's redeliveries of that
// message from being processed while it waits for a person; only rows whose letter was discarded
// go, once the broker can no longer redeliver.
const deleteDeadSQL = `
DELETE FROM {generation} AS i
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {generation} AS i
        WHERE state = 'dead' AND received_at < $1
          AND NOT EXISTS (SELECT 1 FROM {schema}.txbox_dlq AS d
                          WHERE d.source = 'inbox' AND d.consumer = i.consumer AND d.handler = i.handler AND d.dedup_key = i.dedup_key)
        LIMIT $2
        FOR UPDATE SKIP LOCKED))
  AND state = 'dead' AND received_at < $1
  AND NOT EXISTS (SELECT 1 FROM {schema}.txbox_dlq AS d
                  WHERE d.source = 'inbox' AND d.consumer = i.consumer AND d.handler = i.handler AND d.dedup_key = i.dedup_key)`

// An attempt counter is orphaned when its message was settled (an inbox row of its handler, or a
// consumer-wide one, exists: the counter is never read again) or when no delivery came for longer
// than the inbox retention (the broker can no longer redeliver it).
const deleteAttemptsSQL = `
DELETE FROM {schema}.txbox_inbox_attempt AS a
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.txbox_inbox_attempt AS a
        WHERE a.last_at < $1
           OR EXISTS (SELECT 1 FROM {schema}.txbox_inbox AS i
                   WHERE i.consumer = a.consumer AND i.dedup_key = a.dedup_key AND i.handler IN (a.handler, ''))
        LIMIT $2
        FOR UPDATE SKIP LOCKED))
  AND (a.last_at < $1
       OR EXISTS (SELECT 1 FROM {schema}.txbox_inbox AS i
                   WHERE i.consumer = a.consumer AND i.dedup_key = a.dedup_key AND i.handler IN (a.handler, '')))`

// deleteCallResultsSQL keeps the result of a key a pending call has: the relay measures the
// key's replay window from it, and without it would send a call whose key the provider forgot.
const deleteCallResultsSQL = `
DELETE FROM {schema}.txbox_call_result
WHERE ctid = ANY(ARRAY(
        SELECT r.ctid FROM {schema}.txbox_call_result AS r
        WHERE r.completed_at < $1
          AND NOT EXISTS (SELECT 1 FROM {schema}.txbox_outbox AS o WHERE o.kind = 'call' AND o.idempotency_key = r.idempotency_key)
        LIMIT $2
        FOR UPDATE SKIP LOCKED))
  AND completed_at < $1`

// tableSizesSQL reads sizes from the catalog by the schema's plain name ($1), so it needs no
// template. Row counts come from the statistics collector: estimates, but free, and n_dead_tup is
// the bloat that VACUUM has yet to reclaim.
//
// A partitioned table (the inbox) has no storage of its own: its figures are the sums over its
// partitions (pg_partition_tree lists nothing for a table that is not partitioned: it is its own).
const tableSizesSQL = `
SELECT t.name,
       coalesce(sum(pg_total_relation_size(p.relid)), 0)::bigint,
       coalesce(sum(s.n_live_tup), 0)::bigint,
       coalesce(sum(s.n_dead_tup), 0)::bigint
FROM unnest($2::text[]) WITH ORDINALITY AS t(name, ord)
JOIN pg_namespace AS n ON n.nspname = $1
JOIN pg_class AS c ON c.relnamespace = n.oid AND c.relname = t.name
CROSS JOIN LATERAL (SELECT c.oid AS relid WHERE c.relkind <> 'p'
                    UNION ALL
                    SELECT relid FROM pg_partition_tree(c.oid) WHERE c.relkind = 'p') AS p
LEFT JOIN pg_stat_all_tables AS s ON s.relid = p.relid
GROUP BY t.name, t.ord
ORDER BY t.ord`
