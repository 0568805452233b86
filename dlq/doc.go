// Package dlq owns txbox's dead-letter table: messages a consumer gave up on (source "inbox") and
// outbox rows the relay must not publish or execute again (source "relay"). A dead letter waits for a
// person to decide: inspect it, redrive it through the outbox, or discard it.
//
// # Writing
//
// Writer.Add is for txbox's own components: they add a letter in the same transaction as the state
// change that gives up on the message, so a message is never both pending and dead, nor neither.
//
// # Inspecting
//
// Admin.List, Admin.Get and Admin.Count read letters; a Filter selects them by source, kind,
// topic, consumer, handler, reason (a case-insensitive substring), age and id. Ages are measured from a
// letter's first failure, by the database's clock. Stats gives the depth per source for metrics.
//
// # Redriving
//
// Admin.Redrive sends letters back through the outbox, so a redriven message is delivered at
// least once and processed once like any other:
//
//	admin, _ := dlq.NewAdmin(dlq.AdminConfig{Schema: "txbox"})
//	res, err := admin.Redrive(ctx, pool, dlq.Filter{Consumer: "billing", Reason: "timeout"},
//		dlq.RedriveOptions{Rate: 50}) // letters per second
//
// Each small batch is one transaction that locks its letters with FOR UPDATE SKIP LOCKED (two
// redrives never move one letter twice), writes the messages with outbox.Writer.Publish to their
// topics with the same UUID, payload, metadata and partition key, deletes the 'dead' inbox rows of
// inbox letters (the row of the letter's consumer, handler and dedup key, no other), and deletes
// the letters. A redriven message reaches every consumer of its topic
// again: the consumer that gave up on it has lost its 'dead' row and processes it; consumers that
// processed it have a 'done' row and skip it. That is why the inbox must remember processed
// messages for longer than letters wait in the DLQ (see package retention).
//
// Redrive is paced by a token bucket (RedriveOptions.Rate, letters per second): consumers see a
// steady stream rather than the whole DLQ at once. It can be interrupted at any point, since a
// batch is a transaction, and run again to continue.
//
// # Side-effect calls
//
// Relay letters of kind "call" cannot be redriven: such a call may have reached the provider, or
// its idempotency key may be past the provider's replay window, so sending it again could repeat
// the effect. Redrive refuses a selection that contains one (ErrCallNotRedrivable). Reconcile the
// call with the provider by hand (did the charge happen?), then Discard the letter. While it is
// kept, a letter of a call that was sent starts its key's replay window for any call written again
// with the key (Writer.CallFirstSent); a discarded one no longer does.
//
// # Discarding
//
// Admin.Discard deletes letters. The inbox keeps the 'dead' rows of discarded inbox letters, so the
// broker's redeliveries of those messages are still skipped until retention removes the rows.
// Discard and Redrive refuse a filter without conditions unless Filter.All is set.
package dlq
