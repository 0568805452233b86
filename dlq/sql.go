package dlq

const insertSQL = `
INSERT INTO {schema}.txbox_dlq
    (source, kind, topic, consumer, dedup_key, partition_key, uuid, payload, metadata, idempotency_key, reason, error, attempts)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12, $13)`

const statsSQL = `
SELECT count(*) FILTER (WHERE source = 'inbox'),
       coalesce(extract(epoch FROM now() - min(first_failed_at) FILTER (WHERE source = 'inbox')), 0)::float8,
       count(*) FILTER (WHERE source = 'relay'),
       coalesce(extract(epoch FROM now() - min(first_failed_at) FILTER (WHERE source = 'relay')), 0)::float8
FROM {schema}.txbox_dlq`
