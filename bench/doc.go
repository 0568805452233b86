// Package bench measures txbox against the baseline a Watermill user has today, side by side in one
// run: Watermill's own outbox (watermill-sql's PostgreSQL publisher plus components/forwarder) and
// watermill-kafka's Publisher.
//
// It has no API; the benchmarks are in its test files and run only when asked for:
//
//	scripts/bench                                    # every benchmark, summarised as a table
//	go test -run '^$' -bench RelayDrain -benchtime 20000x ./bench/
//
// What is measured, each against a real PostgreSQL (pgtest's server) and Kafka (kfake in process,
// or TXBOX_KAFKA_BROKERS):
//
//   - OutboxPublish: one client writing messages of 200 bytes into the outbox, 1, 10 or 100 per
//     committed transaction. b.N counts messages.
//   - RelayDrain: the time to move a backlog of b.N committed messages from PostgreSQL to Kafka.
//     Each run starts its relay (default settings: 16 shards, batches of 500) or forwarder on a full
//     outbox, so their start-up is counted; the connection pool is opened beforehand, because
//     connecting to PostgreSQL is a one-off cost that would otherwise dominate small backlogs.
//   - InboxDedup: one handler goroutine processing b.N messages through the inbox middleware, fresh
//     and duplicate, against the same handler in a plain transaction without deduplication.
//   - InboxRouter: b.N fresh messages through a Watermill router (a gochannel subscriber, whose
//     messages the router handles concurrently, bounded by the pool's connections), the handler
//     writing one business row, behind the inbox against the same handler without it, writing the
//     row in a transaction of its own.
//   - Latency: commit → consumer receive at a steady 200 messages per second, p50 and p99, with
//     both pipelines polling every 10ms. b.N counts messages.
//
// The first variant of each benchmark is its baseline; scripts/bench reports the others relative to
// it. Numbers depend on the machine, on PostgreSQL's fsync settings and on Kafka; compare variants
// of one run, not runs on different machines.
package bench
