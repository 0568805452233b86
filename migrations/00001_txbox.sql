-- txbox schema. Table names are unqualified on purpose: they are created in the first schema of the
-- connection's search_path, which is how `txbox migrate --schema` and migrations.Up choose where
-- txbox lives. Runtime code always qualifies names with the configured schema.

-- +goose Up

-- Outbox: messages and side-effect calls written in the caller's transaction. A row exists while it
-- is pending; the relay deletes it in the same fenced transaction that records its completion, so
-- "pending" is simply "present" and a row that commits late can never be skipped.
CREATE TABLE txbox_outbox (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind             text        NOT NULL CHECK (kind IN ('message', 'call')),
    -- slot = fnv32a(partition key) mod 256, fixed at write time; relay shards are sets of slots.
    slot             smallint    NOT NULL CHECK (slot BETWEEN 0 AND 255),
    -- message: destination topic. call: reply topic, '' when no reply is wanted.
    topic            text        NOT NULL,
    partition_key    text        NOT NULL,
    -- message: the Watermill message UUID. call: the call's id.
    uuid             text        NOT NULL,
    -- message: the payload. call: the JSON-encoded request.
    payload          bytea       NOT NULL,
    metadata         jsonb       NOT NULL DEFAULT '{}',
    idempotency_key  text        CHECK (length(idempotency_key) <= 255),
    attempts         integer     NOT NULL DEFAULT 0,
    first_attempt_at timestamptz,
    next_attempt_at  timestamptz NOT NULL DEFAULT '-infinity',
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'call') = (idempotency_key IS NOT NULL))
);
CREATE INDEX txbox_outbox_pending ON txbox_outbox (kind, slot, id);

-- Inbox: one row per (consumer, dedup key) that was processed (state 'done') or given up on
-- (state 'dead', its message is in txbox_dlq). The row is inserted in the handler's transaction.
CREATE TABLE txbox_inbox (
    consumer     text        NOT NULL,
    dedup_key    text        NOT NULL,
    message_uuid text        NOT NULL,
    topic        text        NOT NULL,
    state        text        NOT NULL DEFAULT 'done' CHECK (state IN ('done', 'dead')),
    -- The relay lease (shard, fencing token) that published the message, for audits.
    lease_shard  integer,
    lease_token  bigint,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, dedup_key)
);
CREATE INDEX txbox_inbox_received_at ON txbox_inbox (received_at);

-- Delivery attempts, counted outside the handler's transaction and before the handler runs, so a
-- message that kills the process every time still reaches its limit.
CREATE TABLE txbox_inbox_attempt (
    consumer   text        NOT NULL,
    dedup_key  text        NOT NULL,
    attempts   integer     NOT NULL,
    last_error text,
    first_at   timestamptz NOT NULL DEFAULT now(),
    last_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, dedup_key)
);

-- Relay leases, one row per shard. Tokens come from one sequence, so a token is never reused, not
-- even after the shard count changes.
CREATE SEQUENCE txbox_lease_token;
CREATE TABLE txbox_lease (
    shard      integer     PRIMARY KEY,
    shards     integer     NOT NULL,
    owner      text,
    token      bigint      NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT '-infinity'
);

-- Relay processes that are alive, so each can compute its fair share of the shards.
CREATE TABLE txbox_relay_node (
    owner      text        PRIMARY KEY,
    expires_at timestamptz NOT NULL
);

-- Dead letters from consumers (source 'inbox') and from the relay (source 'relay').
CREATE TABLE txbox_dlq (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source          text        NOT NULL CHECK (source IN ('inbox', 'relay')),
    kind            text        NOT NULL DEFAULT 'message' CHECK (kind IN ('message', 'call')),
    topic           text        NOT NULL,
    consumer        text        NOT NULL DEFAULT '',
    dedup_key       text        NOT NULL DEFAULT '',
    partition_key   text        NOT NULL DEFAULT '',
    uuid            text        NOT NULL,
    payload         bytea       NOT NULL,
    metadata        jsonb       NOT NULL DEFAULT '{}',
    idempotency_key text,
    reason          text        NOT NULL,
    error           text        NOT NULL DEFAULT '',
    attempts        integer     NOT NULL DEFAULT 0,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX txbox_dlq_source ON txbox_dlq (source, first_failed_at);

-- Results of side-effect calls, kept for audit and reconciliation.
CREATE TABLE txbox_call_result (
    idempotency_key text        PRIMARY KEY,
    call_uuid       text        NOT NULL,
    outcome         text        NOT NULL,
    http_status     integer     NOT NULL,
    object_id       text        NOT NULL DEFAULT '',
    body            text        NOT NULL DEFAULT '',
    attempts        integer     NOT NULL,
    duration_ms     bigint      NOT NULL,
    completed_at    timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE txbox_call_result;
DROP TABLE txbox_dlq;
DROP TABLE txbox_relay_node;
DROP TABLE txbox_lease;
DROP SEQUENCE txbox_lease_token;
DROP TABLE txbox_inbox_attempt;
DROP TABLE txbox_inbox;
DROP TABLE txbox_outbox;
