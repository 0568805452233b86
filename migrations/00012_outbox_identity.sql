-- An outbox's identity: random, made once, when the schema is migrated. Relays derive the default
-- prefix of their Kafka transactional IDs from it, so that the relays of one outbox share their
-- transactional IDs (a new owner's producer fences the old owner's) while the relays of another
-- outbox on the same Kafka cluster never fence them. A copy of the database (a restore) carries
-- the identity with it: point such a copy at another Kafka cluster, or give its relays their own
-- --transactional-id-prefix.

-- Each relay also records the prefix it publishes with and its shard count, so that a relay
-- started with another prefix or shard count than the running relays of its outbox is refused,
-- even before they hold a lease.

-- +goose Up
ALTER TABLE txbox_relay_node ADD COLUMN transactional_id_prefix text, ADD COLUMN shards integer;

CREATE TABLE txbox_identity (
    only_row  boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    outbox_id text    NOT NULL DEFAULT substr(md5(random()::text || clock_timestamp()::text), 1, 16)
);
INSERT INTO txbox_identity DEFAULT VALUES;

-- +goose Down
DROP TABLE txbox_identity;
ALTER TABLE txbox_relay_node DROP COLUMN transactional_id_prefix, DROP COLUMN shards;
