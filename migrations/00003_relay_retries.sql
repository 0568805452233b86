-- Messages the broker refused, retried per row; the replay window of a call per idempotency key.

-- +goose Up

-- A message the broker refused (a topic that does not exist yet, one the relay may not write to)
-- counts its attempts in txbox_outbox.attempts and waits until next_attempt_at, holding back the
-- later messages of its partition key only. The relay's read looks for such held rows once per
-- candidate row; this index holds only rows that ever failed, so that look costs nothing while
-- none do.
CREATE INDEX txbox_outbox_refused ON txbox_outbox (slot, partition_key, id) WHERE kind = 'message' AND attempts > 0;

-- A call's age is its idempotency key's: measured from the first attempt of any call with the key.
CREATE INDEX txbox_outbox_call_key ON txbox_outbox (idempotency_key) WHERE kind = 'call';
-- NULL for results stored before this migration: their key's first attempt is not known.
ALTER TABLE txbox_call_result ADD COLUMN first_attempt_at timestamptz;

-- +goose Down
ALTER TABLE txbox_call_result DROP COLUMN first_attempt_at;
DROP INDEX txbox_outbox_call_key;
DROP INDEX txbox_outbox_refused;
