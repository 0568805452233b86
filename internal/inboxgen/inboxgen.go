// Package inboxgen holds what the inbox and retention share about inbox generations
// (migrations/00011_inbox_generations.sql): the lock that makes a new generation current only when
// no delivery still inserts into the old one.
//
// The primary key of a partitioned inbox is per generation, so a delivery inserting into a new
// generation cannot see, nor wait for, a delivery of the same message whose row in the old
// generation is not committed yet: both would process the message. Every transaction that inserts
// an inbox row therefore holds the ROW SHARE lock of the generation table from before it reads the
// current generation until it ends, and retention switches the generation holding its EXCLUSIVE
// lock, which waits for every such transaction to end and keeps new ones out until the switch
// commits. Plain reads of the generation table (ACCESS SHARE, taken too when a statement naming it
// is parsed) conflict with neither; the inbox table's own locks would not do: parsing a statement
// that inserts into it would wait behind a rotation, unbounded by the delivery's lock timeout.
//
// The lock is taken with LOCK TABLE, as the transaction's first statement: LOCK is the one
// statement that takes no snapshot, so the snapshot of the statement that reads the generation and
// looks for the message in older ones is taken after the lock is held. In READ COMMITTED any
// statement of its own would do, but in REPEATABLE READ (a database's or role's default) the
// transaction's snapshot is its first statement's: one taken while waiting behind a rotation would
// still see the old generation current once the rotation committed. LOCK in ROW SHARE mode needs
// UPDATE on the table (INSERT is enough from PostgreSQL 16), which the tables' owner has.
package inboxgen

// DeliveryLock, RotationLock and EarlierDeliveriesLock are templates for internal/sqlname.
//
// Deliveries of the versions before this lock (3b1ae55) held an advisory lock shared instead,
// which the EXCLUSIVE lock does not wait for: while such consumers run, as in a rolling upgrade, a
// rotation that took RotationLock alone could switch under one of their deliveries. So a rotation
// takes EarlierDeliveriesLock too, exclusively, after RotationLock. Consumers of this version do
// not take the advisory lock: Cleaners of an earlier version, which wait for it alone, must be
// stopped or upgraded before them (README, "Retention").
const (
	DeliveryLock = `LOCK TABLE {schema}.txbox_inbox_generation IN ROW SHARE MODE`
	RotationLock = `LOCK TABLE {schema}.txbox_inbox_generation IN EXCLUSIVE MODE`
	// The advisory lock's key is a constant that is txbox's and the inbox table's oid, so that every
	// schema has a lock of its own.
	EarlierDeliveriesLock = `SELECT pg_advisory_xact_lock(1953063522, '{schema}.txbox_inbox'::regclass::oid::int)`
)
