package inbox_test

import (
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/kafkasub"
)

// produceWithoutIDs writes records the way any non-Watermill producer does: a plain sarama
// producer, no Watermill UUID header.
func produceWithoutIDs(t *testing.T, topic string, payloads ...string) {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	p, err := sarama.NewSyncProducer(kafkatest.Brokers(t), cfg)
	require.NoError(t, err)
	defer p.Close()
	for _, pl := range payloads {
		_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder(pl)})
		require.NoError(t, err)
	}
}

// Records without a Watermill id, read by a real watermill-kafka subscriber: each distinct record
// gets its own dead letter, keyed by its topic, partition and offset (even records with equal
// payloads), and a redelivery of the same records makes no second letter.
func TestMessagesWithoutIDFromKafkaGetOneLetterEach(t *testing.T) {
	t.Parallel()
	r := newRig(t, func(c *inbox.Config) { c.Delivery = kafkasub.Delivery })
	topic := kafkatest.Topic(t)
	produceWithoutIDs(t, topic, "same", "same", "same", "other")

	// Two consumer groups read the topic from its start: the second delivers every record again,
	// at the same coordinates, to the same inbox consumer.
	r.router.AddConsumerHandler("orders", topic, kafkatest.NewSubscriber(t, "g1-"+topic), r.record)
	r.run(t)
	r.waitAcked(t, 4)
	require.Equal(t, 4, r.count(t, "txbox_dlq", "reason = $1 AND dedup_key LIKE 'kafka:' || $2 || '/%'", inbox.ReasonNoID, topic))

	second := r.newRouter(t)
	second.AddConsumerHandler("orders", topic, kafkatest.NewSubscriber(t, "g2-"+topic), r.record)
	txtest.RunRouter(t, second)
	r.waitAcked(t, 8)
	require.Equal(t, 4, r.count(t, "txbox_dlq", ""), "a redelivery makes no second letter")
	require.Equal(t, 4, r.count(t, "txbox_inbox", "state = 'dead' AND handler = 'orders'"))
	require.Empty(t, r.handledBy(t), "nothing without an id reached the handler")
}

// Without broker coordinates, a message without a usable id is known by a hash of its topic, id
// bytes, payload and metadata: distinct messages get a letter each, a redelivery none. Ids the
// database cannot store as text are treated alike.
func TestMessagesWithoutIDGetOneLetterEach(t *testing.T) {
	t.Parallel()
	r := newRig(t, nil)
	r.router.AddConsumerHandler("orders", "orders.placed", r.pubsub, r.record)
	r.run(t)

	withMeta := message.NewMessage("", []byte("a"))
	withMeta.Metadata.Set("source", "legacy-system")
	msgs := []*message.Message{
		message.NewMessage("", []byte("a")),
		message.NewMessage("", []byte("b")),
		withMeta,
		message.NewMessage("bad-\xff", []byte("a")),
		message.NewMessage("bad-\xff", []byte("b")),
	}
	for _, m := range msgs {
		require.NoError(t, r.pubsub.Publish("orders.placed", m.Copy()))
	}
	r.waitAcked(t, int64(len(msgs)))
	require.Equal(t, len(msgs), r.count(t, "txbox_dlq", "reason = $1", inbox.ReasonNoID))
	for _, m := range msgs {
		require.NoError(t, r.pubsub.Publish("orders.placed", m.Copy()))
	}
	r.waitAcked(t, int64(2*len(msgs)))
	require.Equal(t, len(msgs), r.count(t, "txbox_dlq", ""), "redeliveries make no second letter")
	require.Equal(t, len(msgs), r.count(t, "txbox_dlq", "dedup_key LIKE 'sha256:%'"))
	require.Empty(t, r.handledBy(t))
}
