-- The transaction that wrote a call of a derived idempotency key (pg_current_xact_id, the
-- top-level transaction's id even in a savepoint), so that a second call of the same name for the
-- same message in one transaction is refused, wherever in it the first was written: the two would
-- share the key, and the provider would execute only the first (package outbox). NULL for
-- messages, calls of explicit keys, and calls written before this migration.
--
-- The refusal is the unique index's, through ON CONFLICT DO NOTHING: a read of the outbox instead
-- would take SERIALIZABLE predicate locks on it, and make the writers of different messages' calls
-- fail each other. Adding the column changes only the catalog; building the index reads the
-- outbox once, blocking writes to it meanwhile (a pending backlog, usually small).

-- +goose Up
ALTER TABLE txbox_outbox ADD COLUMN writer_xact xid8;
CREATE UNIQUE INDEX txbox_outbox_call_writer ON txbox_outbox (idempotency_key, writer_xact) WHERE writer_xact IS NOT NULL;

-- +goose Down
DROP INDEX txbox_outbox_call_writer;
ALTER TABLE txbox_outbox DROP COLUMN writer_xact;
