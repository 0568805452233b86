package relay_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/txbox/txbox/internal/proctest"
)

// A produce request that keeps failing with a retriable error makes sarama give up on the records
// it carries after its retries, while the later records of the same partition, sent in later
// requests, succeed. Without Kafka transactions nothing undoes those: if a key's later message
// had been in flight with its failed earlier one, it would be in Kafka first, and the relay's
// retry would put the earlier one behind it. The key's messages must arrive in commit order in both
// modes.
func TestKeyOrderSurvivesAFailedRecord(t *testing.T) {
	t.Parallel()
	for _, transactional := range []bool{true, false} {
		t.Run(map[bool]string{true: "transactional", false: "idempotent"}[transactional], func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			cluster := strictCluster(t, kfake.SeedTopics(1, b.topic))
			log := readTopics(t, cluster.ListenAddrs(), b.topic)
			uuids := b.write(t, true, "k", 20)
			// One more than the relay's sarama retries (5): the first request's records fail for good.
			cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: b.topic, Err: kerr.NotEnoughReplicas, Count: 6})
			var logs proctest.Buffer
			b.runRelayOn(t, b.kafkaSink(t, cluster.ListenAddrs(), transactional), &logs, nil)
			require.Eventually(t, func() bool { return log.has(uuids...) && b.pending(t) == 0 }, 60*time.Second, 10*time.Millisecond)
			require.Equal(t, uuids, log.firstArrivals()["k"], "the key's messages in commit order")
		})
	}
}
