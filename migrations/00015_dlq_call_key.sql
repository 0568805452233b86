-- The relay measures a call's idempotency key's age from the calls with that key in the
-- dead-letter table too, right before each send (package dlq, Writer.CallFirstSent): a call
-- written again with the key of one buried after reaching the provider would otherwise be sent
-- once the provider had forgotten the key. This index keeps that lookup from reading the whole
-- table. Building it reads the dead-letter table once, blocking writes to it meanwhile.

-- +goose Up
CREATE INDEX txbox_dlq_call_key ON txbox_dlq (idempotency_key) WHERE kind = 'call';

-- +goose Down
DROP INDEX txbox_dlq_call_key;
