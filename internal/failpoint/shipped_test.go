package failpoint_test

import (
	"context"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/outbox"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TXBOX_FAILPOINTS=relay.lease-locked must not touch `txbox relay` as users build it. The same
// relay built for the crash tests dies at that point, which shows the point is reached.
func TestShippedRelayIgnoresFailpoints(t *testing.T) {
	t.Parallel()
	arm := []string{failpoint.EnvVar + "=relay.lease-locked"}
	// relay starts a relay on a fresh outbox holding one message; the relay's first completion
	// passes relay.lease-locked, inside the fenced transaction that deletes the row.
	relay := func(t *testing.T, bin string) (*txtest.Env, *proctest.Proc) {
		env := txtest.New(t)
		w, err := outbox.New(outbox.Config{Schema: env.Schema})
		require.NoError(t, err)
		require.NoError(t, w.Publish(context.Background(), env.Pool, kafkatest.Topic(t), message.NewMessage("m-1", []byte("{}"))))
		return env, proctest.StartProgram(t, bin, arm, "relay",
			"--database-url", env.URL, "--schema", env.Schema,
			"--kafka-brokers", strings.Join(kafkatest.Brokers(t), ","), "--transactional-id-prefix", env.Schema,
			"--shards", "1", "--lease-ttl", "1s", "--poll-interval", "10ms", "--metrics-addr", "")
	}
	pending := func(t *testing.T, env *txtest.Env) (n int) {
		require.NoError(t, env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+env.Q("txbox_outbox")).Scan(&n))
		return n
	}

	t.Run("test build", func(t *testing.T) {
		t.Parallel()
		env, p := relay(t, proctest.Binary(t))
		require.Equal(t, -1, p.Wait(60*time.Second), "killed by SIGKILL at the point:\n%s", p.Output())
		require.Equal(t, 1, pending(t, env), "the row was not completed")
	})
	t.Run("shipped build", func(t *testing.T) {
		t.Parallel()
		env, p := relay(t, proctest.BuildShipped(t, "./cmd/txbox"))
		require.Eventually(t, func() bool { return pending(t, env) == 0 || p.Exited() }, 60*time.Second, 10*time.Millisecond)
		require.False(t, p.Exited(), "the relay must run on past the point:\n%s", p.Output())
		require.Zero(t, pending(t, env), "the row was completed, in the transaction that passes the point")
		p.Signal(syscall.SIGTERM)
		require.Zero(t, p.Wait(30*time.Second), "a graceful stop:\n%s", p.Output())
	})
}
