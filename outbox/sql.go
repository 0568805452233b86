package outbox

// insertMessageSQL writes one message, the common case, without arrays.
const insertMessageSQL = `
INSERT INTO {schema}.txbox_outbox (kind, topic, slot, partition_key, uuid, payload, metadata)
VALUES ('message', $1, $2, $3, $4, $5, $6)`

// insertMessagesSQL writes several messages in one statement: arrays keep its text (and so its
// prepared statement and plan) the same for any number of messages, where a VALUES list would be
// planned anew for each. WITH ORDINALITY keeps the caller's order, so messages of one call get
// ascending ids.
const insertMessagesSQL = `
INSERT INTO {schema}.txbox_outbox (kind, topic, slot, partition_key, uuid, payload, metadata)
SELECT 'message', $1, m.slot, m.partition_key, m.uuid, m.payload, m.metadata
FROM unnest($2::smallint[], $3::text[], $4::text[], $5::bytea[], $6::text[])
     WITH ORDINALITY AS m(slot, partition_key, uuid, payload, metadata, ord)
ORDER BY m.ord`

// insertCallSQL writes a call of an explicit key, which may be written twice on purpose.
const insertCallSQL = `
INSERT INTO {schema}.txbox_outbox (kind, topic, slot, partition_key, uuid, payload, metadata, idempotency_key)
VALUES ('call', $1, $2, $3, $4, $5, $6, $7)`

// insertDerivedCallSQL writes a call of a derived key, unless the transaction already holds one
// with the key: two calls of one name for one message. pg_current_xact_id is the top-level
// transaction's id in a savepoint too, and the rows of a savepoint rolled back are gone, so the
// unique index finds the calls that would commit with this one, wherever in the transaction they
// were written (migrations/00014_outbox_call_writer.sql).
const insertDerivedCallSQL = `
INSERT INTO {schema}.txbox_outbox (kind, topic, slot, partition_key, uuid, payload, metadata, idempotency_key, writer_xact)
VALUES ('call', $1, $2, $3, $4, $5, $6, $7, pg_current_xact_id())
ON CONFLICT (idempotency_key, writer_xact) WHERE writer_xact IS NOT NULL DO NOTHING`
