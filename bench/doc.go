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
//   - Latency: commit → consumer receive at a steady 200 messages per second, p50 and p99, with
//     both pipelines polling every 10ms. b.N counts messages.
//
// The relay alone (relay_bench_test.go; not run by scripts/bench):
//
//   - RelayWarmDrain: a relay whose producers are open drains a backlog of b.N messages committed
//     in one transaction, against a bare idempotent sarama producer sending the same records.
//   - RelayLatency: Latency's measurement through the relay with its default settings.
//   - RelayIdle: CPU per second of the process and of its PostgreSQL backends while nothing is
//     written, for b.N milliseconds, the relay with its defaults against the forwarder at 10ms.
//
// The first variant of each benchmark is its baseline; scripts/bench reports the others relative to
// it. Numbers depend on the machine, on PostgreSQL's fsync settings and on Kafka; compare variants
// of one run, not runs on different machines.
package bench
