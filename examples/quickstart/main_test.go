package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/txbox/txbox/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The example is documentation that must stay true: run it, as `go run` would with Kafka left to
// the in-process cluster, in a database of its own, and check the story it tells and the state
// it leaves.
func TestQuickstart(t *testing.T) {
	dsn := pgtest.NewDatabase(t)
	// Everything the example starts, it stops. sarama's metrics library starts one process-wide
	// ticker on first use and never stops it; that one is not ours.
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(),
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"))

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	require.NoError(t, run(ctx, &out, dsn, nil), out.String())
	t.Log("\n" + out.String())
	require.Equal(t, []string{
		"service: order-1 and its event committed in one transaction",
		"billing: invoicing order-1",
		"relay → Kafka → inbox: the event was delivered and processed",
		"kafka delivered the event again; the inbox skipped it: 1 invoice for order-1",
	}, strings.Split(strings.TrimSpace(out.String()), "\n"))

	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var invoices, processed, pending int
	require.NoError(t, conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM txbox_quickstart.invoices),
		(SELECT count(*) FROM txbox_quickstart.txbox_inbox), (SELECT count(*) FROM txbox_quickstart.txbox_outbox)`).
		Scan(&invoices, &processed, &pending))
	require.Equal(t, []int{1, 1, 0}, []int{invoices, processed, pending}, "invoices, inbox rows, outbox rows")
}

// Without a server the example says where it looked and how to point it elsewhere, and prints no
// password.
func TestQuickstartWithoutPostgreSQL(t *testing.T) {
	t.Parallel()
	err := run(context.Background(), &bytes.Buffer{}, "postgres://billing:s3cret@127.0.0.1:1/shop?connect_timeout=5", nil)
	require.Error(t, err)
	require.Contains(t, err.Error(), "cannot reach PostgreSQL at 127.0.0.1:1")
	require.Contains(t, err.Error(), "set TXBOX_DATABASE_URL")
	require.NotContains(t, err.Error(), "s3cret")
}
