-- Crash suspects: a process crash takes down every message in flight, not only the one that caused
-- it, so an attempt that never ended says only that the message is suspect. The inbox runs a suspect
-- alone in its process and charges it a crash only when it crashed running alone.
--
--   attempts   the message's own failed attempts: errors, and crashes while it ran alone (counted
--              before it runs, so the crash still counts; given back when it fails transiently).
--   unfinished attempts that started alongside other messages and have not ended (yet, or ever:
--              the process crashed), the crash marker written before the handler runs.
--   alone      an attempt running alone started and has not ended: if it never does, the message
--              crashed its process by itself.
--   suspected  unfinished attempts set aside when the message started running alone: charged to it
--              (added to attempts) if it crashes alone, forgiven if it then ends.
--
-- Existing counters keep their attempts. Consumers of the version before this one count every
-- delivery in attempts, so during a rolling upgrade a failure may be counted twice.

-- +goose Up
ALTER TABLE txbox_inbox_attempt
    ADD COLUMN unfinished integer NOT NULL DEFAULT 0,
    ADD COLUMN alone      boolean NOT NULL DEFAULT false,
    ADD COLUMN suspected  integer NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE txbox_inbox_attempt DROP COLUMN unfinished, DROP COLUMN alone, DROP COLUMN suspected;
