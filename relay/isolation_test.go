package relay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
)

// A database whose default isolation level is serializable (or repeatable read) is the relay's
// business only where its own transactions are concerned: it runs them read committed, so its
// reads and completions neither fail on its own lease rows ("could not serialize access") nor make
// the application's serializable transactions that write to the outbox fail.
func TestARelayOnASerializableDatabaseLeavesItsWritersAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg := b.env.Pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = pool.Exec(context.Background(), "CREATE TABLE "+b.env.Q("sent")+" (key text, seq int, PRIMARY KEY (key, seq))")
	require.NoError(t, err)
	c := b.collect(t)
	logs := &errorLog{}
	for range 2 {
		b.startRelay(t, func(c *relay.Config) {
			c.DB = pool
			c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
		})
	}

	const writers, perWriter = 8, 30
	var failures atomic.Int64
	var wg sync.WaitGroup
	uuids := make([][]string, writers)
	for w := range writers {
		wg.Go(func() {
			key := fmt.Sprintf("k%d", w)
			for seq := range perWriter {
				m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
				outbox.SetPartitionKey(m, key)
				err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(context.Background(), "INSERT INTO "+b.env.Q("sent")+" VALUES ($1, $2)", key, seq); err != nil {
						return err
					}
					return b.writer.Publish(context.Background(), tx, b.topic, m)
				})
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && pgErr.Code == "40001" {
					failures.Add(1)
					continue
				}
				if !errors.Is(err, nil) {
					t.Error(err)
					return
				}
				uuids[w] = append(uuids[w], m.UUID)
			}
		})
	}
	wg.Wait()
	require.Zero(t, failures.Load(), "the writers' transactions that failed to serialize")
	for _, u := range uuids {
		require.Eventually(t, func() bool { return c.has(u...) }, 30*time.Second, 20*time.Millisecond)
	}
	require.Empty(t, logs.String(), "the relays' warnings and errors")
}

// errorLog collects log lines from several goroutines.
type errorLog struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *errorLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *errorLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}
