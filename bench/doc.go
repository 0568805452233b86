// Package bench measures txbox against its baselines, side by side in one run: plain SQL for the
// outbox write, a raw idempotent sarama producer and Watermill's own outbox (watermill-sql's
// PostgreSQL publisher plus components/forwarder) for the relay, a bare handler for the inbox.
//
// It has no API; the benchmarks are in its test files and run only when asked for. They report
// numbers and never fail on one (no test anywhere holds a wall-clock threshold):
//
//	scripts/bench                                    # issue 11's figures and every result, as tables
//	go test -run '^$' -bench RelayDrain -benchtime 20000x ./bench/
//
// What is measured, each against a real PostgreSQL (pgtest's server) and Kafka (kfake in process,
// or TXBOX_KAFKA_BROKERS), messages of 200 bytes:
//
//   - OutboxPublish: one client writing messages, 1, 10 or 100 per committed transaction, through
//     outbox.Writer (txbox), a plain INSERT of the same topic, key, UUID and payload into an
//     ordinary table (plain-insert, multi-row for several messages: the baseline) and Watermill's
//     outbox publisher. The writers take turns in one benchmark so they meet the same load; each
//     reports <writer>-msgs/s over b.N messages.
//   - RelayDrain: the time to move a backlog of b.N committed messages from PostgreSQL to Kafka,
//     counting from the start of the relay (default settings: 16 shards, batches of 500) or
//     forwarder on a full outbox, so their start-up is counted; the connection pool is opened
//     beforehand, because connecting to PostgreSQL is a one-off cost that would otherwise dominate
//     small backlogs.
//   - RelayDrainWarm: the same, timed from when the first tenth has arrived: the steady rate, against
//     a raw idempotent sarama producer sending the same records straight to Kafka; txbox-no-broker
//     is the relay with a sink that sends nothing, its database work alone: a bound on any broker.
//   - InboxDedup: one handler goroutine processing b.N messages through the inbox middleware called
//     directly, fresh and duplicate, against the same handler in a plain transaction; sql-floor-row
//     and sql-floor-row-and-marker are that transaction with, in plain SQL, the least an inbox adds
//     (a keyed row, and a crash marker committed before it): bounds, not txbox.
//   - InboxRouter: fresh messages through a Watermill router (in-memory pub/sub, one handler), the
//     handler behind the inbox middleware against the bare handler.
//   - Latency: commit → consumer receive at a steady 500 messages per second, p50 and p99, the relay
//     with its defaults and the forwarder polling every 10ms; then, per second while the pipeline
//     is idle, the CPU time of this process and of the PostgreSQL backends answering its polls.
//     txbox-stages splits the relay's latency by its producer spans: commit → row read, the Kafka
//     transaction, Kafka commit → consumer. b.N counts messages.
//   - TestSoak (TXBOX_SOAK=1, skipped otherwise): the whole pipeline — writers in transactions of
//     5 messages, the relay, Kafka, a Watermill router behind the inbox writing a business row —
//     for TXBOX_SOAK_DURATION (default 10m) at TXBOX_SOAK_RATE messages/s (default 70 % of the
//     maximum an unthrottled burst measures first), with the retention Cleaner scaled to the
//     duration (generations of a tenth of it, inbox retention a fifth, a pass every quarter
//     generation), one message in 100 sent again up to a generation after it was written (a
//     broker's redelivery), and, on a server without autovacuum, a VACUUM of txbox's tables every
//     interval. It logs per interval a Markdown table of the rates, the outbox backlog, the
//     consumer's lag, the inbox's generations, and the size, index size and dead/live tuples of
//     txbox_outbox, txbox_inbox (all partitions) and txbox_inbox_attempt; then the throughput
//     drift, each table's and index's size once the inbox has filled and at the end, and what
//     retention and VACUUM did. It asserts only that every message is processed exactly once
//     (copies included), that the pipeline drains and that no retention pass leaves more than
//     inbox retention / generation + 2 generations.
//
// scripts/bench runs them all and prints, with bench/cmd/benchtable, each figure issue 11 asks for
// against its baseline and goal. Numbers depend on the machine, its load, PostgreSQL's fsync
// settings and Kafka; compare figures of one run, not runs on different machines (BENCHMARKS.md).
package bench
