package outbox

// WITH ORDINALITY keeps the caller's order, so messages of one call get ascending ids.
const insertMessagesSQL = `
INSERT INTO {schema}.txbox_outbox (kind, topic, slot, partition_key, uuid, payload, metadata)
SELECT 'message', $1, m.slot, m.partition_key, m.uuid, m.payload, m.metadata::jsonb
FROM unnest($2::smallint[], $3::text[], $4::text[], $5::bytea[], $6::text[])
     WITH ORDINALITY AS m(slot, partition_key, uuid, payload, metadata, ord)
ORDER BY m.ord`

const insertCallSQL = `
INSERT INTO {schema}.txbox_outbox (kind, topic, slot, partition_key, uuid, payload, metadata, idempotency_key)
VALUES ('call', $1, $2, $3, $4, $5, $6::jsonb, $7)`
