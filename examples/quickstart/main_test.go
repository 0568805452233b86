package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// The example is documentation that must stay true: run it and check the story it tells. run itself
// verifies the database's final state and fails otherwise; this test checks that the story says so.
func TestQuickstart(t *testing.T) {
	// The test suite names its server TXBOX_TEST_DATABASE_URL; the example reads TXBOX_DATABASE_URL.
	if v := os.Getenv("TXBOX_TEST_DATABASE_URL"); v != "" && os.Getenv("TXBOX_DATABASE_URL") == "" {
		t.Setenv("TXBOX_DATABASE_URL", v)
	}
	// Everything the example starts, it stops. sarama's metrics library starts one process-wide
	// ticker on first use and never stops it; that one is not ours.
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(),
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"))

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	require.NoError(t, run(ctx, &out), out.String())
	story := out.String()
	t.Log("\n" + story)

	uuid := regexp.MustCompile(`order 1: .*\(uuid ([0-9a-f-]{36})\)`).FindStringSubmatch(story)
	require.NotNil(t, uuid, "order 1's event uuid is told")
	for _, line := range []string{
		"order 2: wrote the order row and its OrderPlaced event in one transaction; rolled back",
		"outbox: 2 pending messages",
		"relay: published 2 messages",
		"inbox: duplicate delivery of " + uuid[1] + " recognised and skipped",
		"order 2: rolled back, so neither its row nor its event exists; it never reached Kafka",
		"final state: alice's balance is 350 (100 + 250); each order applied once; inbox holds 2 processed messages",
	} {
		require.Contains(t, story, line)
	}
	require.Equal(t, 1, strings.Count(story, "handler: applied order 1 "), "order 1 applied once")
	require.Equal(t, 1, strings.Count(story, "handler: applied order 3 "), "order 3 applied once")
	require.NotContains(t, story, "handler: applied order 2 ")
	require.Less(t, strings.Index(story, "relay: published"), strings.Index(story, "inbox: duplicate delivery"),
		"the story is told in the order it happened")
}
