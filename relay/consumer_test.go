package relay_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
)

// consumer is a Watermill router reading the bundle's topic with read_committed, behind the inbox,
// whose handler records each message's business effect in the effects table: one row per
// processing, numbered in processing order.
type consumer struct {
	inbox *inbox.Inbox
	reg   *prometheus.Registry
}

func (b *bundle) startConsumer(t *testing.T) *consumer {
	t.Helper()
	ctx := context.Background()
	_, err := b.env.Pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+b.env.Q("effects")+
		" (seq bigint GENERATED ALWAYS AS IDENTITY, uuid text NOT NULL, key text NOT NULL)")
	require.NoError(t, err)
	c := &consumer{reg: prometheus.NewRegistry()}
	c.inbox, err = inbox.New(inbox.Config{DB: b.env.Pool, Consumer: "effects", Schema: b.env.Schema, Delivery: kafkasub.Delivery, Registerer: c.reg}, nil)
	require.NoError(t, err)

	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	router.AddMiddleware(c.inbox.Middleware)
	router.AddConsumerHandler("effects", b.topic, kafkatest.NewSubscriber(t, "effects-"+b.env.Schema), func(msg *message.Message) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "INSERT INTO "+b.env.Q("effects")+" (uuid, key) VALUES ($1, $2)",
			msg.UUID, msg.Metadata.Get(outbox.PartitionKeyMetadata))
		return err
	})
	txtest.RunRouter(t, router)
	return c
}

// effects returns, per message UUID, how many times its business effect was applied, and per
// partition key the UUIDs in processing order.
func (b *bundle) effects(t *testing.T) (applied map[string]int, order map[string][]string) {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(), "SELECT uuid, key FROM "+b.env.Q("effects")+" ORDER BY seq")
	require.NoError(t, err)
	defer rows.Close()
	applied, order = map[string]int{}, map[string][]string{}
	for rows.Next() {
		var u, k string
		require.NoError(t, rows.Scan(&u, &k))
		applied[u]++
		order[k] = append(order[k], u)
	}
	require.NoError(t, rows.Err())
	return applied, order
}

// allAppliedOnce reports whether every UUID's effect was applied, each exactly once so far.
func (b *bundle) allAppliedOnce(t *testing.T, uuids []string) bool {
	applied, _ := b.effects(t)
	for _, u := range uuids {
		if applied[u] != 1 {
			return false
		}
	}
	return true
}
