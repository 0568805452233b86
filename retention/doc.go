// Package retention deletes the rows txbox no longer needs: processed inbox rows, dead inbox rows
// whose letter was discarded, orphaned attempt counters and old call results. The inbox goes by
// generations, dropped whole (see Generations); the rest goes in small batches, one short
// statement each. It reports the tables' sizes so bloat is visible.
//
//	c, err := retention.New(retention.Config{
//		DB:              pool,
//		Schema:          "txbox",
//		BrokerRetention: 7*24*time.Hour + 7*24*time.Hour, // Kafka retention.ms + segment.ms
//		InboxRetention:  21 * 24 * time.Hour,
//	})
//	go c.Run(ctx) // a pass now, then every Config.Interval
//
// # How long the inbox must remember
//
// An inbox row is what makes a second delivery of a message a duplicate. Two things can deliver a
// message again, and each sets a bound:
//
//  1. The broker, for as long as it keeps the message (Config.BrokerRetention). So a processed
//     ('done') row must outlive it: Config.InboxRetention must be longer than BrokerRetention, and
//     New refuses anything else. The difference is the margin for a consumer that lags or retries.
//
//  2. A DLQ redrive, at any time while the letter waits. A redriven message goes to every consumer
//     of its topic, and each consumer that processed the original must still have its 'done' row
//     to skip the copy. Those consumers processed the original at most BrokerRetention before the
//     letter was written (the failing consumer received the same message within the broker's
//     retention), so every pass measures the 'done' cutoff back from the oldest inbox letter in
//     the DLQ as well as from now:
//
//     cutoff = min(now, oldest inbox letter's first failure) - InboxRetention
//
//     A letter that waits long therefore holds the inbox's cleanup back by its age; the pass logs
//     a warning when that exceeds InboxRetention, and Report.OldestLetterAge shows it. Of the
//     relay's letters, only those of messages an operator buried count (relay.Admin.Bury: a
//     message being published as it is buried may reach the broker and its consumers too), and
//     those of redriven messages the broker refused (it refused the copy, and the consumers
//     processed the original); the others are of messages the broker refused, which no consumer
//     ever saw.
//
//  3. The redriven copy itself, which the broker keeps for its whole retention from the redrive.
//     Once the letter is gone it no longer holds the cutoff back, so the redrive records the
//     message (UUID and topic) with its time, and the receipt time of every inbox row of such a
//     message that is due (received before now - InboxRetention, redriven after) moves forward
//     to the redrive before the row could go: each consumer remembers a redriven message for
//     InboxRetention from the redrive. Redrive records older than that are deleted. The rows are
//     found when they could go rather than at the redrive, which would need an index by message
//     UUID on every inbox insert: in the current generation, by every pass, among the rows it is
//     about to delete (Report.RedrivenKept); in an older generation, by one scan of it before it
//     is dropped, made only when a redrive record keeps rows.
//
//  4. A letter of a redriven copy. A consumer that fails on the copy writes a new letter, which
//     holds the cutoff back (rule 2) only from the rows received within BrokerRetention before
//     it: not from those of consumers that processed the original before the redrive, to which
//     the new letter's redrive will send another copy. So a redrive record is kept, and keeps
//     its message's rows as in rule 3, also while a letter of its message is in the DLQ.
//
// 'dead' rows are never deleted while their letter is in the DLQ: they keep the broker's
// redeliveries of that message from being processed while it waits for a person, and a redrive
// deletes them itself. Once the letter is discarded, the row goes after InboxRetention, like a
// 'done' row. Attempt counters go once their message is settled, or when no delivery came for
// InboxRetention. Call results are kept for Config.CallResultRetention, for audit and
// reconciliation, and beyond it while a call with the same idempotency key is pending: the relay
// measures the key's replay window from its result.
//
// # Generations
//
// The inbox is partitioned by generation (migrations/00011_inbox_generations.sql). Inboxes insert
// into the current one; a pass makes a new one current once the current one is
// Config.InboxGeneration old, and drops every older generation whose newest row is past the 'done'
// cutoff: DETACH PARTITION CONCURRENTLY, then DROP TABLE. No row of a generation that is no longer
// current is deleted one by one, even once it is past the cutoff: such a generation takes no insert
// that could reuse the space, so a DELETE would reclaim nothing before the drop, and only leave
// dead tuples for VACUUM; the row goes with its generation, at most a generation later (and the
// inbox still makes its message's deliveries duplicates meanwhile). Before the drop, the rows that
// must stay move to the current generation: 'dead' rows whose letter is in the DLQ, and the rows of
// messages redriven within InboxRetention or with a letter waiting since their redrive (with their
// receipt time moved forward to the redrive). A message redriven after the pass read its cutoffs
// is not in a generation it drops: the letter was in the DLQ then, and held the cutoff back from
// the consumers' rows of it (rule 2), or kept the record of an earlier redrive (rule 4).
//
// The primary key is per generation, so a delivery looks for its message in every generation
// alive (one index probe each; about InboxRetention/InboxGeneration+1 of them) and inserts into
// the current one. Two deliveries of one message on either side of a switch could not see each
// other's uncommitted rows, so each inbox transaction holds the generation table's ROW SHARE lock from
// its first statement and the switch takes its EXCLUSIVE lock (internal/inboxgen): it waits for the
// deliveries in flight, those of earlier versions too (README, "Retention", on upgrading), and new
// ones wait behind it. Config.GenerationLockTimeout bounds both waits: a consumer frozen in its
// handler (holding its transaction open up to inbox.Config.IdleInTransactionTimeout) makes the
// rotation give up and retry at the next pass, never the other deliveries wait for it.
//
// The trade-off is Config.InboxGeneration: rows stay up to one generation longer than
// InboxRetention (more storage), against one more index probe per delivery for every generation
// alive. The default, a day, keeps 16 to 17 generations at the default InboxRetention of 15 days.
//
// DETACH PARTITION CONCURRENTLY blocks no delivery, but, like CREATE INDEX CONCURRENTLY, it waits
// for every transaction of the database older than it to end: a long report, a pg_dump, a consumer
// frozen in its handler (at most inbox.Config.IdleInTransactionTimeout) delay the pass. A pass
// stopped meanwhile (its context, a statement_timeout) leaves the generation pending detach, and
// the next pass finishes it.
//
// While a move runs, a redrive skips the letters it moves (it locks them FOR KEY SHARE, and a
// redrive takes letters SKIP LOCKED): they stay in the DLQ for the next redrive. Several Cleaners
// may run; should two drop one generation at once, one of them fails, and its next pass finishes
// what is left (interrupted detaches, detached tables).
//
// # Batches
//
// The inbox rows past the cutoff in the current generation, the one generation that cannot be
// dropped, are deleted in batches: the rows of generation 0 (the inbox from before it had
// generations) until the first rotation, and rows moved in whose reason went since (a 'dead' row's
// letter discarded, a redrive older than InboxRetention with no letter of its message waiting).
// With InboxGeneration shorter than InboxRetention, no row inserted by a delivery is among them.
// Each batch picks at most Config.BatchSize rows by ctid, skipping rows another session has
// locked, and deletes them in one statement, so no lock lasts longer than one batch and VACUUM can reclaim space while the pass
// goes on. The inbox is read through its received_at index; the attempt and call result tables have
// no index on their timestamps, so each of their batches scans until it has found its rows, which
// is cheap while cleanup keeps up.
package retention
