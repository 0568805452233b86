// Package retention deletes the rows txbox no longer needs: processed inbox rows, dead inbox rows
// whose letter was discarded, orphaned attempt counters and old call results. It deletes in small
// batches, one short statement each, and reports the tables' sizes so bloat is visible.
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
//     a warning when that exceeds InboxRetention, and Report.OldestLetterAge shows it. Relay
//     letters do not count: the broker refused them, so no consumer ever saw them.
//
//  3. The redriven copy itself, which the broker keeps for its whole retention from the redrive.
//     Once the letter is gone it no longer holds the cutoff back, so the redrive records the
//     message (UUID and topic) with its time, and every pass first moves the receipt time of
//     every inbox row of such a message that is due (received before now - InboxRetention,
//     redriven after) forward to the redrive: each consumer remembers a redriven message for
//     InboxRetention from the redrive (Report.RedrivenKept). Redrive records older than that are
//     deleted. The rows are found when they come due rather than at the redrive, which would need
//     an index by message UUID on every inbox insert; moving received_at also moves a row out of
//     an old partition should the inbox ever be partitioned by it.
//
// 'dead' rows are never deleted while their letter is in the DLQ: they keep the broker's
// redeliveries of that message from being processed while it waits for a person, and a redrive
// deletes them itself. Once the letter is discarded, the row goes after InboxRetention, like a
// 'done' row. Attempt counters go once their message is settled, or when no delivery came for
// InboxRetention. Call results are kept for Config.CallResultRetention, for audit and
// reconciliation; nothing else reads them.
//
// # Batches
//
// Each batch picks at most Config.BatchSize rows by ctid, skipping rows another session has
// locked, and deletes them in one statement, so no lock lasts longer than one batch and VACUUM can
// reclaim space while the pass goes on. The inbox is read through its received_at index; the
// attempt and call result tables have no index on their timestamps, so each of their batches scans
// until it has found its rows, which is cheap while cleanup keeps up.
package retention
