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

// countAttemptSQL returns no row when the message already has an inbox row: the cheap path for
// duplicates, taken without opening the handler's transaction.
const countAttemptSQL = `
INSERT INTO {schema}.txbox_inbox_attempt AS a (consumer, dedup_key, attempts)
SELECT $1, $2, 1
WHERE NOT EXISTS (SELECT 1 FROM {schema}.txbox_inbox WHERE consumer = $1 AND dedup_key = $2)
ON CONFLICT (consumer, dedup_key) DO UPDATE SET attempts = a.attempts + 1, last_at = now()
RETURNING attempts, last_error`

const recordErrorSQL = `
UPDATE {schema}.txbox_inbox_attempt SET last_error = left($3, 4000)
WHERE consumer = $1 AND dedup_key = $2`

const deleteAttemptsSQL = `DELETE FROM {schema}.txbox_inbox_attempt WHERE consumer = $1 AND dedup_key = $2`

const insertInboxSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, message_uuid, topic, lease_shard, lease_token)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (consumer, dedup_key) DO NOTHING`

const insertDeadSQL = `
INSERT INTO {schema}.txbox_inbox (consumer, dedup_key, message_uuid, topic, state)
VALUES ($1, $2, $3, $4, 'dead')
ON CONFLICT (consumer, dedup_key) DO NOTHING`
