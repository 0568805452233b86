// Package inbox is a Watermill handler middleware that makes message processing effectively once.
//
// # How
//
// For each message the middleware opens a PostgreSQL transaction and inserts (consumer, handler,
// dedup key) into the inbox table with ON CONFLICT DO NOTHING. If the row already exists the message was
// processed before: it is acknowledged without calling the handler. Otherwise the handler runs with
// the transaction in its context (TxFromContext); its business writes, the messages it writes with
// the outbox, and the messages it returns (written into the outbox for the handler's publish topic,
// never published directly by the router) all commit together with the inbox row. A handler error
// rolls everything back and is returned, so Watermill's retry and nack work as usual.
//
// A redelivery that races the first delivery waits on the inbox row's lock and then sees the
// committed row, so two consumer instances never both run the handler for one message. The wait is
// bounded by Config.LockTimeout, and a consumer frozen in its handler holds the row for at most
// Config.IdleInTransactionTimeout: PostgreSQL then ends its session, so its late commit fails and
// the message is processed once, by another delivery. Both are set in the first statement of the
// transaction, at no extra round trip.
//
// # Generations
//
// The inbox table is partitioned by generation, so that retention drops old rows a generation at a
// time instead of deleting them one by one (package retention). The row goes into the current
// generation, whose primary key catches a racing delivery as above; the insert also looks for the
// message in every older generation alive, one index probe each. Each inbox transaction first
// takes the generation table's ROW SHARE lock, in the same round trip as the insert: retention
// takes its EXCLUSIVE lock to switch generations, so a delivery never inserts into the new generation while
// one of the same message is uncommitted in the old (internal/inboxgen). That switch makes new
// deliveries wait at most retention's Config.GenerationLockTimeout, and a delivery that waits
// longer than LockTimeout fails transiently, like any lock wait.
//
// # Scope
//
// A message is processed once per consuming handler. The handler is the name of the router handler
// (message.HandlerNameFromCtx), so an inbox added to a whole router keeps one memory per handler:
// two handlers on one topic each process every message, and one message id seen on two topics by
// two handlers is processed by both. Outside a router the handler is "" and the scope is the
// consumer. A row with handler "" (written outside a router, or before migration 00002 added the
// handler) settles the message for every handler of its consumer.
//
// # Attempts and dead letters
//
// With MaxAttempts set, each delivery writes a crash marker in its own small transaction before the
// handler runs, committed in the round trip that opens the handler's transaction, just before it. A message that fails, or kills the process, MaxAttempts times is moved to the
// dead-letter table on its next delivery and acknowledged. A crash takes down every message in
// flight, so a marker left by one only makes its message a suspect: a suspect runs alone in its
// process (no other delivery of the Inbox runs meanwhile), and a crash counts against a message only
// when it ran alone. The crashes a suspect was in flight for count too if it then crashes alone, and
// are forgiven if it does not: a message is never dead-lettered for another's crashes. A delivery that fails for reasons that are not the
// message's gives its attempt back: it never reached the handler (a duplicate that gave up waiting
// on another instance's lock, no connection in time), or it ended in a serialization failure, a
// deadlock, a lock timeout, a lost connection, a server shutting down, the cancellation of the
// delivery's context at shutdown, or an outbox write that found the schema lacking a migration
// (outbox.ErrSchemaOutdated: handlers deployed before txbox migrate up ran). A handler frozen past IdleInTransactionTimeout counts, like a
// crash, and so does a panic in the handler, which the middleware lets pass without ending the
// attempt (Watermill's router recovers it and nacks the message). A message with no usable id, a payload over the
// limit, or a handler error wrapping ErrUnprocessable goes there at once.
//
// # Middleware order
//
// Put the inbox innermost (added last, after Watermill's Retry middleware), so each retry is a new
// transaction and a new counted attempt:
//
//	router.AddMiddleware(middleware.Retry{MaxRetries: 3}.Middleware, ib.Middleware)
//
// Whatever the inbox wraps runs in its one transaction, and the inbox sees only its outcome: a
// middleware inside it that re-runs the handler (Retry, Duplicator) commits every run's writes, and
// one that turns an error into success (PoisonQueue, IgnoreErrors) commits a failed handler's
// writes and marks the message processed. Watermill applies router-level middlewares outside
// handler-level ones, so an inbox added to the router and a Retry added to a handler put Retry
// inside: add the inbox to the handler then, or both at one level with the inbox last.
package inbox
