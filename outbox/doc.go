// Package outbox writes outgoing messages into the txbox outbox table inside a transaction the
// caller owns.
//
// # Why
//
// Publishing to a broker from inside a database transaction is either lost (the transaction rolls
// back after the publish) or duplicated (the publish is retried after a commit whose result was
// lost). Writing the message into the same transaction as the business rows makes the message exist
// exactly when the business change does; the txbox relay then publishes it, at least once, and the
// consumer's inbox makes processing effectively once.
//
// # Use
//
//	w, err := outbox.New(outbox.Config{})            // once, at start-up
//	...
//	tx, _ := pool.Begin(ctx)
//	_, _ = tx.Exec(ctx, `INSERT INTO orders ...`)
//	msg := message.NewMessage(watermill.NewUUID(), payload)
//	outbox.SetPartitionKey(msg, orderID)              // same key → same order on the topic
//	_ = w.Publish(ctx, tx, "orders", msg)
//	_ = tx.Commit(ctx)
//
// The package does no network I/O: it only inserts rows.
//
// # Order
//
// Messages with the same partition key that were written by transactions which ran one after the
// other are published in that order. Messages of one Publish call keep their order. Messages from
// concurrent transactions have no order to keep.
package outbox
