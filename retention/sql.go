package retention

import "github.com/txbox/txbox/internal/sqlname"

type queries struct {
	cutoffs, keepRedriven, deleteDone, deleteDead, deleteAttempts, deleteRedrives, deleteCallResults string
}

func renderQueries(schema string) queries {
	r := func(s string) string { return sqlname.Render(s, schema) }
	return queries{
		cutoffs:           r(cutoffsSQL),
		keepRedriven:      r(keepRedrivenSQL),
		deleteRedrives:    r(deleteRedrivesSQL),
		deleteDone:        r(deleteDoneSQL),
		deleteDead:        r(deleteDeadSQL),
		deleteAttempts:    r(deleteAttemptsSQL),
		deleteCallResults: r(deleteCallResultsSQL),
	}
}

// cutoffsSQL computes a pass's cutoffs by the database's clock, from the retentions in
// microseconds ($1 inbox, $2 call results). The 'done' cutoff is also measured back from the
// oldest inbox letter still in the DLQ (see the package documentation for why); relay letters
// were never delivered, so no inbox row is about them.
const cutoffsSQL = `
SELECT now(),
       least(now(), coalesce(d.oldest, now())) - $1 * interval '1 microsecond',
       now() - $1 * interval '1 microsecond',
       now() - $2 * interval '1 microsecond',
       d.oldest
FROM (SELECT min(first_failed_at) AS oldest FROM {schema}.txbox_dlq WHERE source = 'inbox') AS d`

// Each delete takes one batch: it picks at most $2 rows by ctid, skipping rows another session has
// locked, and deletes them in one short statement. The conditions are repeated outside the
// subquery: should a row change between the two, PostgreSQL rechecks them on its newest version.

// keepRedrivenSQL moves the receipt time of inbox rows received before the cutoff $1 forward to
// the redrive of their message, when that came after the cutoff: the redriven copy can still be
// delivered, so every consumer that has a row for the message must keep it (package doc). It
// touches only rows that are due, so each pass reads what it is about to delete anyway; an
// inbox partitioned by receipt time would have the rows moved out of a partition before it is
// dropped.
const keepRedrivenSQL = `
UPDATE {schema}.txbox_inbox AS i
SET received_at = r.redriven_at
FROM {schema}.txbox_redrive AS r
WHERE i.ctid = ANY(ARRAY(
        SELECT i.ctid FROM {schema}.txbox_inbox AS i
        JOIN {schema}.txbox_redrive AS r ON r.message_uuid = i.message_uuid AND r.topic = i.topic
        WHERE i.received_at < $1 AND r.redriven_at >= $1
        LIMIT $2
        FOR UPDATE OF i SKIP LOCKED))
  AND r.message_uuid = i.message_uuid AND r.topic = i.topic
  AND i.received_at < $1 AND r.redriven_at >= $1`

// deleteRedrivesSQL forgets redrives older than the cutoff $1: no inbox row needs them any more.
const deleteRedrivesSQL = `
DELETE FROM {schema}.txbox_redrive
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.txbox_redrive
        WHERE redriven_at < $1
        LIMIT $2
        FOR UPDATE SKIP LOCKED))
  AND redriven_at < $1`

const deleteDoneSQL = `
DELETE FROM {schema}.txbox_inbox
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.txbox_inbox
        WHERE state = 'done' AND received_at < $1
        LIMIT $2
        FOR UPDATE SKIP LOCKED))
  AND state = 'done' AND received_at < $1`

// A 'dead' row whose letter is still in the DLQ is what keeps the broker's redeliveries of that
// message from being processed while it waits for a person; only rows whose letter was discarded
// go, once the broker can no longer redeliver.
const deleteDeadSQL = `
DELETE FROM {schema}.txbox_inbox AS i
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.txbox_inbox AS i
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

const deleteCallResultsSQL = `
DELETE FROM {schema}.txbox_call_result
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {schema}.txbox_call_result
        WHERE completed_at < $1
        LIMIT $2
        FOR UPDATE SKIP LOCKED))
  AND completed_at < $1`

// tableSizesSQL reads sizes from the catalog by the schema's plain name ($1), so it needs no
// template. Row counts come from the statistics collector: estimates, but free, and n_dead_tup is
// the bloat that VACUUM has yet to reclaim.
const tableSizesSQL = `
SELECT t.name,
       coalesce(pg_total_relation_size(c.oid), 0),
       coalesce(s.n_live_tup, 0),
       coalesce(s.n_dead_tup, 0)
FROM unnest($2::text[]) WITH ORDINALITY AS t(name, ord)
JOIN pg_namespace AS n ON n.nspname = $1
JOIN pg_class AS c ON c.relnamespace = n.oid AND c.relname = t.name
LEFT JOIN pg_stat_all_tables AS s ON s.relid = c.oid
ORDER BY t.ord`
