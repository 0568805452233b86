-- Inbox generations: txbox_inbox becomes a table partitioned by LIST (generation), so retention
-- drops a whole generation of old rows instead of deleting them one by one (package retention).
-- txbox_inbox_generation holds the current generation, the one inboxes insert into; retention
-- starts a new one every InboxGeneration and drops a generation once its newest row is past the
-- inbox retention.
--
-- A unique index of a partitioned table must include the partition key, so the primary key is
-- per generation: the inbox looks for the message in every live generation before it inserts
-- into the current one (package inbox).
--
-- The existing table becomes generation 0, without being rewritten: the new column has a constant
-- default (a catalog change only). Under an ACCESS EXCLUSIVE lock on the inbox, the migration then
-- scans the table once, to prove the partition constraint, and builds a unique index that includes
-- the generation, unless these exist already. For a large inbox, prepare both beforehand without
-- blocking consumers, and the migration only changes the catalog:
--
--   ALTER TABLE txbox_inbox ADD COLUMN generation bigint NOT NULL DEFAULT 0;
--   ALTER TABLE txbox_inbox ADD CONSTRAINT txbox_inbox_g0_generation CHECK (generation = 0) NOT VALID;
--   ALTER TABLE txbox_inbox VALIDATE CONSTRAINT txbox_inbox_g0_generation;
--   CREATE UNIQUE INDEX CONCURRENTLY txbox_inbox_g0_pkey ON txbox_inbox (consumer, dedup_key, handler, generation);
--
-- Consumers of the version before this one fail (and are retried) against the new key: roll the
-- new version out with the migration.

-- +goose Up
CREATE TABLE txbox_inbox_generation (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    generation bigint      NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO txbox_inbox_generation (generation) VALUES (0);

-- The default of the generation column, for rows inserted by hand: the inbox names the generation
-- itself. search_path is the migration's, so the function reads this schema's table.
CREATE FUNCTION txbox_inbox_current_generation() RETURNS bigint
    LANGUAGE sql STABLE SET search_path FROM CURRENT
    AS 'SELECT generation FROM txbox_inbox_generation';

ALTER TABLE txbox_inbox ADD COLUMN IF NOT EXISTS generation bigint NOT NULL DEFAULT 0;
ALTER TABLE txbox_inbox RENAME TO txbox_inbox_g0;
ALTER INDEX txbox_inbox_received_at RENAME TO txbox_inbox_g0_received_at;
CREATE UNIQUE INDEX IF NOT EXISTS txbox_inbox_g0_pkey ON txbox_inbox_g0 (consumer, dedup_key, handler, generation);
-- The parent's primary key takes over a partition's index only if it backs a constraint too.
ALTER TABLE txbox_inbox_g0 DROP CONSTRAINT txbox_inbox_pkey,
    ADD CONSTRAINT txbox_inbox_g0_pkey PRIMARY KEY USING INDEX txbox_inbox_g0_pkey;
-- +goose StatementBegin
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = 'txbox_inbox_g0'::regclass AND conname = 'txbox_inbox_g0_generation') THEN
        ALTER TABLE txbox_inbox_g0 ADD CONSTRAINT txbox_inbox_g0_generation CHECK (generation = 0);
    END IF;
END
$$;
-- +goose StatementEnd
ALTER TABLE txbox_inbox_g0 VALIDATE CONSTRAINT txbox_inbox_g0_generation;

CREATE TABLE txbox_inbox (
    consumer     text        NOT NULL,
    dedup_key    text        NOT NULL,
    message_uuid text        NOT NULL,
    topic        text        NOT NULL,
    -- Named as generation 0 names it: a partition must have its parent's check constraints.
    state        text        NOT NULL DEFAULT 'done' CONSTRAINT txbox_inbox_state_check CHECK (state IN ('done', 'dead')),
    lease_shard  integer,
    lease_token  bigint,
    received_at  timestamptz NOT NULL DEFAULT now(),
    handler      text        NOT NULL DEFAULT '',
    generation   bigint      NOT NULL DEFAULT txbox_inbox_current_generation(),
    PRIMARY KEY (consumer, dedup_key, handler, generation)
) PARTITION BY LIST (generation);
-- Retention finds a generation's newest row with it.
CREATE INDEX txbox_inbox_received_at ON txbox_inbox (received_at);

ALTER TABLE txbox_inbox ATTACH PARTITION txbox_inbox_g0 FOR VALUES IN (0);
ALTER TABLE txbox_inbox_g0 DROP CONSTRAINT txbox_inbox_g0_generation;

-- +goose Down
-- One table again, with every generation's rows; a message in two generations (retention moved
-- it, and stopped before it dropped the old generation) keeps its newest row.
ALTER TABLE txbox_inbox RENAME TO txbox_inbox_generations;
ALTER INDEX txbox_inbox_received_at RENAME TO txbox_inbox_generations_received_at;
ALTER TABLE txbox_inbox_generations RENAME CONSTRAINT txbox_inbox_pkey TO txbox_inbox_generations_pkey;
CREATE TABLE txbox_inbox (
    consumer     text        NOT NULL,
    dedup_key    text        NOT NULL,
    message_uuid text        NOT NULL,
    topic        text        NOT NULL,
    state        text        NOT NULL DEFAULT 'done' CONSTRAINT txbox_inbox_state_check CHECK (state IN ('done', 'dead')),
    lease_shard  integer,
    lease_token  bigint,
    received_at  timestamptz NOT NULL DEFAULT now(),
    handler      text        NOT NULL DEFAULT '',
    PRIMARY KEY (consumer, dedup_key, handler)
);
CREATE INDEX txbox_inbox_received_at ON txbox_inbox (received_at);
INSERT INTO txbox_inbox (consumer, dedup_key, handler, message_uuid, topic, state, lease_shard, lease_token, received_at)
SELECT DISTINCT ON (consumer, dedup_key, handler)
       consumer, dedup_key, handler, message_uuid, topic, state, lease_shard, lease_token, received_at
FROM txbox_inbox_generations
ORDER BY consumer, dedup_key, handler, generation DESC;
DROP TABLE txbox_inbox_generations;
DROP FUNCTION txbox_inbox_current_generation();
DROP TABLE txbox_inbox_generation;
