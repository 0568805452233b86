-- Deduplication per consuming handler: a message is processed once per (consumer, handler), so two
-- handlers of one router reading one topic each process every message.
--
-- Rows written before this migration get handler '' (the default): they were recorded for the
-- whole consumer, and the inbox keeps honouring them for every handler of that consumer. The new
-- column comes last in each primary key, so that check reads the same index entries as the
-- handler's own row. Attempt counters of messages failing during the upgrade start again under
-- the handler's name; the old ones are removed by retention.
--
-- Rebuilding a primary key locks its table while the index builds. Consumers of the version before
-- this one fail (and are retried) against the new keys: roll the new version out with the
-- migration.

-- +goose Up
ALTER TABLE txbox_inbox ADD COLUMN handler text NOT NULL DEFAULT '';
ALTER TABLE txbox_inbox DROP CONSTRAINT txbox_inbox_pkey, ADD PRIMARY KEY (consumer, dedup_key, handler);

ALTER TABLE txbox_inbox_attempt ADD COLUMN handler text NOT NULL DEFAULT '';
ALTER TABLE txbox_inbox_attempt DROP CONSTRAINT txbox_inbox_attempt_pkey, ADD PRIMARY KEY (consumer, dedup_key, handler);

ALTER TABLE txbox_dlq ADD COLUMN handler text NOT NULL DEFAULT '';

-- Messages redriven from the DLQ: the redriven copy can be delivered again for the broker's whole
-- retention, so retention keeps every consumer's inbox rows of the message (by its UUID and topic)
-- for InboxRetention from the redrive, not from their first receipt. It moves such rows' received_at
-- forward when they come due, rather than the redrive doing it: finding them by message UUID would
-- need an index on every inbox insert.
CREATE TABLE txbox_redrive (
    message_uuid text        NOT NULL,
    topic        text        NOT NULL,
    redriven_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (message_uuid, topic)
);

-- +goose Down
DROP TABLE txbox_redrive;

-- Back to one row per (consumer, dedup key): of several handlers' rows one is kept, so the older
-- version skips the message for the whole consumer, as it did before.
DELETE FROM txbox_inbox AS a USING txbox_inbox AS b
WHERE a.consumer = b.consumer AND a.dedup_key = b.dedup_key AND a.handler > b.handler;
ALTER TABLE txbox_inbox DROP CONSTRAINT txbox_inbox_pkey, DROP COLUMN handler, ADD PRIMARY KEY (consumer, dedup_key);

DELETE FROM txbox_inbox_attempt AS a USING txbox_inbox_attempt AS b
WHERE a.consumer = b.consumer AND a.dedup_key = b.dedup_key AND a.handler > b.handler;
ALTER TABLE txbox_inbox_attempt DROP CONSTRAINT txbox_inbox_attempt_pkey, DROP COLUMN handler, ADD PRIMARY KEY (consumer, dedup_key);

ALTER TABLE txbox_dlq DROP COLUMN handler;
