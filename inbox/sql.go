package inbox

import "github.com/txbox/txbox/internal/sqlname"

type queries struct {
	countAttempt, recordError, deleteAttempts, insertInbox, insertDead string
}

func renderQueries(schema string) queries {
	return queries{
		countAttempt:   sqlname.Render(countAttemptSQL, schema),
		recordError:    sqlname.Render(recordErrorSQL, schema),
		deleteAttempts: sqlname.Render(deleteAttemptsSQL, schema),
		insertInbox:    sqlname.Render(insertInboxSQL, schema),
		insertDead:     sqlname.Render(insertDeadSQL, schema),
	}
}

// Every statement names a message's scope as $1 consumer, $2 dedup key, $3 handler.
//
// A row with handler '' was written outside a router, or before deduplication was per handler
// (migration 00002): it settles the message for every handler of the consumer. Handler comes last
// in the primary key, so looking for both rows reads one range of the same index, in the same
// statement: honouring old rows costs no round trip.

// noConsumerWideRow is true unless a consumer-wide row (one with an empty handler) settled the
// message.
const noConsumerWideRow = `($3::text = '' OR NOT EXISTS (
    SELECT 1 FROM {schema}.txbox_inbox WHERE consumer = $1 AND dedup_key = $2 AND handler = ''))`

// countAttemptSQL returns no row when the message already has an inbox row: the cheap path for
// duplicates, taken without opening the handler's transaction.
const countAttemptSQL = `
INSERT INTO {schema}.txbox_inbox_attempt AS a (consumer, dedup_key, handler, attempts)
SELECT $1, $2, $3, 1
WHERE NOT EXISTS (SELECT 1 FROM {schema}.txbox_inbox WHERE consumer = $1 AND dedup_key = $2 AND handler IN ($3, ''))
ON CONFLICT (consumer, dedup_key, handler) DO UPDATE SET attempts = a.attempts + 1, last_at = now()
RETURNING attempts, last_error`

const recordErrorSQL = `
UPDATE {schema}.txbox_inbox_attempt SET last_error = left($4, 4000)
WHERE consumer = $1 AND dedup_key = $2 AND handler = $3`

const deleteAttemptsSQL = `DELETE FROM {schema}.txbox_inbox_attempt WHERE consumer = $1 AND dedup_key = $2 AND handler = $3`

const insertInboxSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, lease_shard, lease_token)
SELECT $1, $2, $3, $4::text, $5::text, $6::integer, $7::bigint
WHERE ` + noConsumerWideRow + `
ON CONFLICT (consumer, dedup_key, handler) DO NOTHING`

const insertDeadSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state)
SELECT $1, $2, $3, $4::text, $5::text, 'dead'
WHERE ` + noConsumerWideRow + `
ON CONFLICT (consumer, dedup_key, handler) DO NOTHING`
