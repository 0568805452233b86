-- The transaction that wrote a call of a derived idempotency key (pg_current_xact_id, the
-- top-level transaction's id even in a savepoint), so that a second call of the same name for the
-- same message in one transaction is refused, wherever in it the first was written: the two would
-- share the key, and the provider would execute only the first (package outbox). NULL for
-- messages, calls of explicit keys, and calls written before this migration. Adding a column
-- without a default changes only the catalog.

-- +goose Up
ALTER TABLE txbox_outbox ADD COLUMN writer_xact xid8;

-- +goose Down
ALTER TABLE txbox_outbox DROP COLUMN writer_xact;
