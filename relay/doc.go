// Package relay moves committed outbox rows out of the database: it publishes messages to a broker
// (Kafka through KafkaSink, or any Watermill publisher) and executes side-effect calls written with
// outbox.Call. Relays share the outbox through per-shard leases with fencing tokens; every state
// change a relay makes runs in a transaction that locks its lease row and checks its token.
//
// # Reading without skipping
//
// A row is pending while it exists: the relay deletes it in the fenced transaction that records
// its completion. The relay therefore reads "what is present, in id order", never "ids above the
// last one seen", so a transaction that took a low id and committed late is read when it commits,
// and an uncommitted row is never seen.
//
// A read costs what it returns, not what is pending: it reads each of its shard's slots in id order
// through the (kind, slot, id) index and merges them, so a shard with nothing to do answers in one
// index descent per slot while other shards have a backlog of millions. Rows a read passes over
// are those held back (a refused message's later messages, a call behind an earlier call of its
// key); relay/scan_test.go checks the bounds with EXPLAIN ANALYZE on a backlog of 200,000 rows.
//
// # Finding new rows
//
// A shard worker with a backlog reads batch after batch; the completion of a full batch reads the
// next one in its own round trip. A worker that found fewer rows than a batch parks, and one
// goroutine per relay (watch) looks for due messages in the slots of every parked shard with a
// single query, waking only the shards that have some. It looks every PollInterval while rows
// come and backs off to IdlePollInterval while none do. A look reads what is pending, like a read,
// so it cannot miss a late commit; at worst a row waits for the next look.
//
// # Shards, leases and fencing
//
// Partition keys hash to one of 256 slots (outbox.SlotOf); Config.Shards splits the slots into
// shards, each owned by at most one relay at a time through a lease row (shard, owner, token,
// expires_at). Taking a free or expired lease draws a new token from a sequence; the database
// clock decides expiry. Each relay takes its fair share, ceil(shards / live relays), renews every
// LeaseTTL/3, and releases its leases when it stops. Every state change a relay makes runs in a
// transaction that first locks the shard's lease row FOR UPDATE and checks the token: a takeover
// either committed before (the check fails and the shard is dropped) or waits until the change
// commits. With KafkaSink, each shard publishes through a transactional producer whose
// transactional.id derives from the shard, so a new owner's producer fences the old owner's, and
// each batch is one Kafka transaction that read_committed consumers see whole or not at all.
//
// Every transaction a relay runs is bounded by its LeaseTTL: a lock is waited for at most TTL/4, a
// statement runs at most one TTL, and a session left idle inside the transaction is ended by
// PostgreSQL after TTL/3. A relay frozen inside a fenced transaction therefore holds its lease row
// for TTL/3 at most, and nobody queues behind it for longer than TTL/4. Starting up takes no table
// lock. Each relay also wakes up when another relay's lease or heartbeat runs out, so a dead or
// frozen relay's shards are taken over about one TTL after its last renewal.
//
// sarama's calls cannot be cancelled: KafkaSink leaves a call that outlives its context (the lease
// ended, or a graceful stop waited one TTL) on a goroutine of its own, which aborts the transaction
// and closes the producer when sarama returns.
//
// # Messages the broker refuses
//
// A message the broker refuses does not stall its shard. Brokers refuse batches as a whole (a Kafka
// transaction aborts, a refusal is reported against every record in it), so the relay publishes
// halves of a refused batch until the refused message is published alone; KafkaSink also checks
// each topic's metadata and each record's size before a batch enters a transaction. A message that
// can never be accepted (invalid topic name, record too large) goes to the dead-letter table at
// once (ReasonRejected). One refused for a reason that may pass (its topic does not exist yet, the
// relay may not write to it) counts the attempt in its row, waits MinPublishBackoff to
// MaxPublishBackoff before the next, holding back the later messages of its partition key only,
// and goes to the dead-letter table after Config.MaxPublishAttempts
// (ReasonPublishAttemptsExhausted). Without Kafka transactions a batch goes out in rounds holding
// at most one message per partition key, so a record sarama gives up on never has a later message
// of its key in flight beside it.
//
// Admin shows operators the backlog per shard and the pending rows, and moves a row to the
// dead-letter table by hand (Admin.Bury), locking the shard's lease row like the relay does.
//
// # Side-effect calls
//
// With Config.Calls set, each shard lease runs a call worker beside its message worker. For each
// due call of the shard:
//
//  1. In a fenced transaction, record the attempt (first_attempt_at is set once, attempts counts
//     up) and measure the age of the call's idempotency key with the database clock: from the first
//     attempt of any call written with that key, pending, completed or dead-lettered after it was
//     sent, since the provider forgets a key a fixed time after it first saw it. A call whose key
//     is older than CallConfig.ReplayWindow goes to the dead-letter table in that same
//     transaction and is never sent.
//  2. Send it through stripe-go with its Idempotency-Key, within a deadline that is the smaller of
//     CallConfig.Timeout and the time left in the replay window, counted from before step 1.
//  3. In a fenced transaction, act on the answer: a 2xx, a business refusal (402, a declined card)
//     or a request the provider refuses outright (other 400s, 404) is an outcome: store it in
//     txbox_call_result, write the reply message if the call asked for one, delete the row. A 409
//     (the key is in use), 429, 5xx, timeout or connection error is retried later with the same
//     key. An idempotency_error (the key was used with other parameters) or a failure the provider
//     stored for the key (so every retry replays it) goes to the dead-letter table.
//
// Crashes and takeovers between the steps are harmless because of the key: a call sent and not
// completed is sent again by whoever holds the lease next, and the provider replays its stored
// answer, or answers 409 while the first request still runs, which is retried. The reply's UUID is
// derived from the key, so the relay and a zombie can only ever write the same reply.
//
// Calls with the same partition key run one after the other in the order they were written; a call
// being retried holds back the later calls of its key.
//
// Leases do not bound a call: the relay renews its leases every LeaseTTL/3 on its own while calls
// are in flight. A relay that loses its lease mid-call cancels the request and concludes nothing.
//
// # Residual risk
//
// Stripe forgets idempotency keys after 24 hours, and a call sent after that with a key it had
// executed is executed again. The relay never starts a send past the replay window (default 23h),
// and the request's deadline is set before the age check, so a request can reach Stripe late only
// if the process stops dead between its last deadline check and the bytes leaving, for longer than
// the margin between the window and 24 hours (plus network latency). The realistic case is a
// suspended machine: Go's monotonic clock does not advance while the machine sleeps. Keep the
// margin (24h minus ReplayWindow) larger than any pause you consider possible.
package relay
