// Package inboxgen holds what the inbox and retention share about inbox generations
// (migrations/00011_inbox_generations.sql): the lock that makes a new generation current only when
// no delivery still inserts into the old one.
//
// The primary key of a partitioned inbox is per generation, so a delivery inserting into a new
// generation cannot see, nor wait for, a delivery of the same message whose row in the old
// generation is not committed yet: both would process the message. Every transaction that inserts
// an inbox row therefore holds the lock shared from before it reads the current generation until
// it ends, and retention switches the generation while holding it exclusively, after every such
// transaction ended. The lock is taken in a statement of its own: in READ COMMITTED a statement's
// snapshot is taken when it starts, so the statement that reads the generation and looks for the
// message in older ones must start after the lock is held.
package inboxgen

// LockKey is the arguments of pg_advisory_xact_lock_shared and pg_advisory_xact_lock, in a template
// for internal/sqlname: a constant that is txbox's, and the inbox table's oid, so every schema has a
// lock of its own.
const LockKey = `1953063522, '{schema}.txbox_inbox'::regclass::oid::int`
