-- The operator console (txbox console): its audit of every change an operator made through it, and
-- an index that lets it find a call's result by the provider's object id.

-- +goose Up

-- One row per mutation an operator asked the console for: who (the name the operator signed in
-- with), what (the action), which target (letter ids, a filter, an outbox row), when (the database
-- clock) and what came of it. Written in the same transaction as the change where the library
-- allows it (discard, bury); a paced redrive runs in many transactions, so it gets a row when it
-- starts and one when it ends.
CREATE TABLE txbox_console_audit (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    operator text        NOT NULL,
    action   text        NOT NULL,
    target   text        NOT NULL,
    detail   text        NOT NULL DEFAULT '',
    result   text        NOT NULL
);
CREATE INDEX txbox_console_audit_at ON txbox_console_audit (at);

-- Reconciliation starts from what the provider shows: a charge id.
CREATE INDEX txbox_call_result_object_id ON txbox_call_result (object_id) WHERE object_id <> '';

-- +goose Down
DROP INDEX txbox_call_result_object_id;
DROP TABLE txbox_console_audit;
