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

const insertCallSQL = `
INSERT INTO {schema}.txbox_outbox (kind, topic, slot, partition_key, uuid, payload, metadata, idempotency_key)
VALUES ('call', $1, $2, $3, $4, $5, $6, $7)`
