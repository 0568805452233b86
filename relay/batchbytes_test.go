package relay_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// batchSink records each batch it is given.
type batchSink struct {
	mu      sync.Mutex
	batches [][]relay.Message
}

func (s *batchSink) Open(context.Context, int, int64) (relay.ShardPublisher, error) { return s, nil }

func (s *batchSink) Publish(_ context.Context, msgs []relay.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.batches = append(s.batches, append([]relay.Message(nil), msgs...))
	return nil
}

func (s *batchSink) Close() error { return nil }

// A batch holds at most BatchBytes of payload, except a message larger than that, which goes
// alone; the messages still go out once each, in order.
func TestBatchBytesBoundsABatch(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const budget = 1024
	ctx := context.Background()
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	var want []string
	for i := range 13 {
		size := 200
		if i == 6 {
			size = 3 * budget
		}
		m := outbox.SetPartitionKey(message.NewMessage(watermill.NewUUID(), []byte(strings.Repeat("x", size))), "k")
		require.NoError(t, b.writer.Publish(ctx, tx, b.topic, m))
		want = append(want, m.UUID)
	}
	require.NoError(t, tx.Commit(ctx))

	sink := &batchSink{}
	b.startRelay(t, func(cfg *relay.Config) { cfg.Sink, cfg.Shards, cfg.BatchBytes = sink, 1, budget })
	require.Eventually(t, func() bool { return b.pending(t) == 0 }, 30*time.Second, 10*time.Millisecond)

	sink.mu.Lock()
	defer sink.mu.Unlock()
	var got []string
	var multi int
	for _, batch := range sink.batches {
		bytes := 0
		for _, m := range batch {
			got = append(got, m.Msg.UUID)
			bytes += len(m.Msg.Payload)
		}
		if len(batch) > 1 {
			multi++
			require.LessOrEqual(t, bytes, budget, "a batch of %d messages", len(batch))
		}
	}
	require.Equal(t, want, got, "every message once, in order")
	require.Greater(t, multi, 0, "messages that fit together are batched")
}
