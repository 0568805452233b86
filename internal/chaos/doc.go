// Package chaos tests txbox's guarantees end to end with real processes, a real PostgreSQL and a
// Kafka-protocol cluster, while processes are killed at every step.
//
// Its tests (chaos_test.go and beside it) run `txbox relay` processes and consumer processes
// (cmd/txbox-consumer: a Watermill router with a read_committed Kafka subscriber behind the inbox
// middleware), kill them with SIGKILL at failpoints (TXBOX_FAILPOINTS, see internal/failpoint) and
// at random times, pause relays past their lease, restart them as a supervisor would, and then
// check the invariants with Check: every committed message applied exactly once per consumer, in
// per-key order, nothing left in the outbox, nothing dead-lettered, one external charge per key.
//
// # Seeds
//
// TestChaos derives everything it decides — failpoints, kill times, messages, keys, batch sizes —
// from a seed it logs as "seed=N". Replay one iteration with
//
//	go test ./internal/chaos -run '^TestChaos$' -count=1 -args -chaos.seed=N -chaos.iterations=1
//
// (or TXBOX_CHAOS_SEED=N). The plan is replayed exactly; the interleaving of real processes is not,
// so a rare failure may need a few replays.
//
// # Long runs
//
// CI runs a few short iterations. For hundreds, run scripts/chaos (CHAOS_ITERATIONS=300 by default);
// each iteration takes 10 to 20 seconds on two cores.
package chaos
