package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/migrations"
)

// result is what one txbox invocation did.
type result struct {
	code           int
	stdout, stderr string
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// cliEnv is a migrated schema and the environment txbox runs with: TXBOX_DATABASE_URL carries a
// password (the test server trusts every connection, so any password works), and no output of any
// invocation may contain it.
type cliEnv struct {
	*txtest.Env
	password string
	vars     map[string]string
}

func newCLIEnv(t *testing.T) *cliEnv {
	t.Helper()
	env := txtest.New(t)
	pw := "pw-" + rand.Text()
	return &cliEnv{Env: env, password: pw, vars: map[string]string{
		"TXBOX_DATABASE_URL": withPassword(t, env.URL, pw),
		"TXBOX_SCHEMA":       env.Schema,
	}}
}

func withPassword(t *testing.T, dsn, pw string) string {
	t.Helper()
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		require.NoError(t, err)
		u.User = url.UserPassword(u.User.Username(), pw)
		return u.String()
	}
	return dsn + " password=" + pw
}

// txbox runs txbox in process with the environment's variables plus extra ("" unsets one) and
// checks that the password appears in no output.
func (e *cliEnv) txbox(t *testing.T, extra map[string]string, args ...string) result {
	t.Helper()
	r := e.exec(context.Background(), nil, extra, args...)
	e.requireNoSecret(t, r)
	return r
}

// exec runs txbox, writing its standard error to stderr as well when that is given. It may run
// on any goroutine: it asserts nothing.
func (e *cliEnv) exec(ctx context.Context, stderr *proctest.Buffer, extra map[string]string, args ...string) result {
	vars := map[string]string{}
	for k, v := range e.vars {
		vars[k] = v
	}
	for k, v := range extra {
		vars[k] = v
	}
	if stderr == nil {
		stderr = &proctest.Buffer{}
	}
	var stdout proctest.Buffer
	code := invoke(ctx, args, vars, &stdout, stderr)
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

func (e *cliEnv) requireNoSecret(t *testing.T, r result) {
	t.Helper()
	require.NotContains(t, r.stdout, e.password, "the password leaked:\n%s", r)
	require.NotContains(t, r.stderr, e.password, "the password leaked:\n%s", r)
}

// snapshot describes the test schema's tables and their row counts, to show a command changed
// nothing.
func (e *cliEnv) snapshot(t *testing.T) string {
	t.Helper()
	rows, err := e.Pool.Query(context.Background(), `
		SELECT table_name || '=' || (xpath('/row/c/text()', query_to_xml(format('SELECT count(*) AS c FROM %I.%I', table_schema, table_name), false, true, '')))[1]::text
		FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1`, e.Schema)
	require.NoError(t, err)
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return strings.Join(tables, " ")
}

func (e *cliEnv) schemaExists(t *testing.T, schema string) bool {
	t.Helper()
	var ok bool
	require.NoError(t, e.Pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&ok))
	return ok
}

func (e *cliEnv) tables(t *testing.T, schema string) []string {
	t.Helper()
	rows, err := e.Pool.Query(context.Background(), `SELECT table_name FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1`, schema)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return names
}

func (e *cliEnv) dropSchemaLater(t *testing.T, schema string) {
	t.Cleanup(func() {
		_, err := e.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		if err != nil {
			t.Logf("drop %s: %v", schema, err)
		}
	})
}

// Every value txbox cannot use is a usage error (exit 2) that names the flag and its environment
// variable, shows no secret, and changes nothing in the database.
func TestUsageErrors(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	typo := e.Schema + "_typo"
	relay := []string{"relay", "--kafka-brokers", "127.0.0.1:1", "--metrics-addr", ""}
	retention := []string{"retention", "--broker-retention", "7d"}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want []string // in stderr
	}{
		// Commands and arguments.
		{args: nil, want: []string{"no command given"}},
		{args: []string{"frobnicate"}, want: []string{`unknown command "frobnicate"`}},
		{args: []string{"migrate"}, want: []string{"txbox migrate needs a subcommand: down, status, up"}},
		{args: []string{"migrate", "sideways"}, want: []string{`unknown command "sideways" for "txbox migrate"`}},
		{args: []string{"dlq"}, want: []string{"txbox dlq needs a subcommand"}},
		{args: []string{"dlq", "purge"}, want: []string{`unknown command "purge"`}},
		{args: []string{"dlq", "list", "extra"}, want: []string{`unknown command "extra"`}},
		{args: []string{"dlq", "show"}, want: []string{"accepts 1 arg(s), received 0"}},
		{args: []string{"dlq", "show", "abc"}, want: []string{`"abc" is not a letter id`}},
		{args: []string{"relay", "--shard", "3"}, want: []string{"unknown flag: --shard"}},
		{args: []string{"version", "extra"}, want: []string{`unknown command "extra"`}},

		// Connection and schema.
		{args: []string{"status"}, env: map[string]string{"TXBOX_DATABASE_URL": ""}, want: []string{"--database-url / TXBOX_DATABASE_URL is set but empty\n"}},
		// A template that rendered nothing, not a request for the default.
		{args: relay, env: map[string]string{"TXBOX_LEASE_TTL": ""}, want: []string{"--lease-ttl / TXBOX_LEASE_TTL is set but empty; unset the variable for the default"}},
		{args: []string{"status", "--database-url", "postgres://app:hunter2@db:notaport/app"}, want: []string{"--database-url / TXBOX_DATABASE_URL is not a valid PostgreSQL connection string"}},
		{args: []string{"status", "--database-url", ""}, want: []string{"--database-url / TXBOX_DATABASE_URL must not be empty"}},
		{args: []string{"dlq", "list", "--schema", ""}, want: []string{"--schema / TXBOX_SCHEMA must not be empty (leave it out for public)"}},
		{args: []string{"migrate", "up", "--schema="}, want: []string{"--schema / TXBOX_SCHEMA must not be empty"}},
		// pgxpool's own settings, in spellings pgx's error text does not mask the password of.
		{args: []string{"status"}, env: map[string]string{"TXBOX_DATABASE_URL": "host=127.0.0.1 user=app password = " + e.password + " pool_max_conns=abc"},
			want: []string{`--database-url / TXBOX_DATABASE_URL is not a usable PostgreSQL connection string: cannot parse pool_max_conns (strconv.ParseInt: parsing "abc": invalid syntax)`}},
		{args: []string{"migrate", "up"}, env: map[string]string{"TXBOX_DATABASE_URL": `host=127.0.0.1 user=app password=x\ ` + e.password + " pool_max_conns=0"},
			want: []string{"--database-url / TXBOX_DATABASE_URL is not a usable PostgreSQL connection string: pool_max_conns too small"}},
		{args: []string{"migrate", "up", "--schema", "information_schema"}, want: []string{"--schema / TXBOX_SCHEMA", "system schemas"}},
		{args: []string{"migrate", "up", "--schema", "pg_catalog"}, want: []string{"--schema / TXBOX_SCHEMA", "system schemas"}},
		{args: []string{"migrate", "up"}, env: map[string]string{"TXBOX_SCHEMA": "pg_toast"}, want: []string{"--schema / TXBOX_SCHEMA", "system schemas"}},
		{args: []string{"dlq", "list", "--schema", "Bad-Schema"}, want: []string{"--schema / TXBOX_SCHEMA", "not a valid name"}},
		{args: []string{"migrate", "status", "--schema", typo}, want: []string{"--schema / TXBOX_SCHEMA", "does not exist"}},
		{args: []string{"migrate", "down", "--schema", typo}, want: []string{"--schema / TXBOX_SCHEMA", "does not exist"}},
		{args: []string{"migrate", "down", "--force", "--schema", typo}, want: []string{"--schema / TXBOX_SCHEMA", "does not exist"}},
		{args: []string{"dlq", "list", "--schema", typo}, want: []string{"--schema / TXBOX_SCHEMA", "does not exist"}},
		{args: []string{"dlq", "discard", "--all", "--schema", typo}, want: []string{"--schema / TXBOX_SCHEMA", "does not exist"}},
		{args: []string{"status", "--schema", typo}, want: []string{"--schema / TXBOX_SCHEMA", "does not exist"}},
		{args: append(retention, "--schema", typo), want: []string{"--schema / TXBOX_SCHEMA", "does not exist"}},
		{args: []string{"status", "--schema", "public"}, want: []string{"--schema / TXBOX_SCHEMA", `txbox is not installed in schema "public"`}},

		// Logging.
		{args: []string{"status", "--log-level", "verbose"}, want: []string{`--log-level / TXBOX_LOG_LEVEL must be one of debug, info, warn, error, got "verbose"`}},
		{args: []string{"status"}, env: map[string]string{"TXBOX_LOG_FORMAT": "xml"}, want: []string{"--log-format / TXBOX_LOG_FORMAT must be one of text, json"}},

		// relay.
		{args: []string{"relay"}, want: []string{"--kafka-brokers / TXBOX_KAFKA_BROKERS is required"}},
		{args: []string{"relay", "--kafka-brokers", "k1:9092,"}, want: []string{"--kafka-brokers / TXBOX_KAFKA_BROKERS must be a comma-separated list"}},
		{args: []string{"relay", "--kafka-brokers", "k1"}, want: []string{`--kafka-brokers / TXBOX_KAFKA_BROKERS must be host:port, got "k1"`}},
		{args: []string{"relay", "--kafka-brokers", "k1:99999"}, want: []string{`--kafka-brokers / TXBOX_KAFKA_BROKERS must be host:port with a port number up to 65535, got "k1:99999"`}},
		{args: []string{"relay", "--kafka-brokers", "k1:kafka"}, want: []string{`--kafka-brokers / TXBOX_KAFKA_BROKERS must be host:port with a port number up to 65535, got "k1:kafka"`}},
		{args: []string{"relay", "--kafka-brokers", "k1:0"}, want: []string{`--kafka-brokers / TXBOX_KAFKA_BROKERS: "k1:0": the port must be a number from 1 to 65535`}},
		{args: append(relay, "--shards", "7"), want: []string{"--shards / TXBOX_SHARDS must divide 256 (1, 2, 4, ... 256), got 7"}},
		{args: relay, env: map[string]string{"TXBOX_SHARDS": "7"}, want: []string{"--shards / TXBOX_SHARDS must divide 256 (1, 2, 4, ... 256), got 7"}},
		{args: append(relay, "--shards", "0"), want: []string{"--shards / TXBOX_SHARDS must divide 256"}},
		{args: append(relay, "--shards", "512"), want: []string{"--shards / TXBOX_SHARDS must divide 256"}},
		{args: append(relay, "--batch-size", "0"), want: []string{`--batch-size / TXBOX_BATCH_SIZE must be a whole number from 1 to 10000, got "0"`}},
		{args: append(relay, "--batch-bytes", "100"), want: []string{`--batch-bytes / TXBOX_BATCH_BYTES must be a whole number from 1024 to 1073741824, got "100"`}},
		{args: append(relay, "--lease-ttl", "100ms"), want: []string{`--lease-ttl / TXBOX_LEASE_TTL must be a duration from 1s to 10m`}},
		{args: append(relay, "--lease-ttl", "0"), want: []string{`--lease-ttl / TXBOX_LEASE_TTL must be a duration`}},
		{args: append(relay, "--poll-interval", "0"), want: []string{`--poll-interval / TXBOX_POLL_INTERVAL must be a duration from 1ms to 1m`}},
		{args: relay, env: map[string]string{"TXBOX_POLL_INTERVAL": "soon"}, want: []string{`--poll-interval / TXBOX_POLL_INTERVAL must be a duration from 1ms to 1m, written like 90s, 15m, 36h or 7d, got "soon"`}},
		{args: append(relay, "--idle-poll-interval", "2m"), want: []string{`--idle-poll-interval / TXBOX_IDLE_POLL_INTERVAL must be a duration from 1ms to 1m`}},
		{args: append(relay, "--poll-interval", "50ms", "--idle-poll-interval", "10ms"), want: []string{"txbox: --idle-poll-interval / TXBOX_IDLE_POLL_INTERVAL must be at least 50ms"}},
		{args: append(relay, "--transactional", "false"), want: []string{`unknown command "false" for "txbox relay" (a true/false flag takes its value after =, as in --transactional=false)`}},
		{args: append(relay, "--transactional=maybe"), want: []string{`--transactional / TXBOX_TRANSACTIONAL must be true or false, got "maybe"`}},
		{args: append(relay, "--owner", " "), want: []string{"--owner / TXBOX_RELAY_OWNER must not be empty"}},
		{args: append(relay, "--transactional-id-prefix", " "), want: []string{"--transactional-id-prefix / TXBOX_TRANSACTIONAL_ID_PREFIX must not be empty"}},
		{args: append(relay, "--transactional-id-prefix="), want: []string{"--transactional-id-prefix / TXBOX_TRANSACTIONAL_ID_PREFIX must not be empty"}},
		{args: append(relay, "--metrics-addr", "9464"), want: []string{`--metrics-addr / TXBOX_METRICS_ADDR must be host:port, got "9464" (or "off" for no listener)`}},
		{args: append(relay, "--metrics-addr", "OFF"), want: []string{`--metrics-addr / TXBOX_METRICS_ADDR must be host:port, got "OFF" (or "off" for no listener)`}},
		{args: append(relay, "--stripe-base-url", "ftp://stripe"), want: []string{"--stripe-base-url / TXBOX_STRIPE_BASE_URL must be an http(s) URL"}},
		{args: relay, env: map[string]string{"TXBOX_STRIPE_BASE_URL": "https://proxy:" + e.password + "@stripe.internal"},
			want: []string{"--stripe-base-url / TXBOX_STRIPE_BASE_URL must be an http(s) URL without a user name or password"}},
		{args: append(relay, "--stripe-base-url", "https://proxy:"+e.password+"@not a host"), want: []string{"(the value is not shown)"}},
		{args: append(relay, "--call-replay-window", "24h"), want: []string{"--call-replay-window / TXBOX_CALL_REPLAY_WINDOW must be a duration from 1m to 23h59m"}},
		{args: append(relay, "--call-timeout", "1m"), want: []string{"--call-timeout / TXBOX_CALL_TIMEOUT (1m) must not be longer than --lease-ttl / TXBOX_LEASE_TTL (10s)"}},
		{args: append(relay, "--call-timeout", "1h"), want: []string{"--call-timeout / TXBOX_CALL_TIMEOUT must be a duration from 100ms to 10m"}},
		{args: append(relay, "--call-timeout", "0"), want: []string{"--call-timeout / TXBOX_CALL_TIMEOUT must be a duration from 100ms"}},
		{args: append(relay, "--max-call-backoff", "25h"), want: []string{"--max-call-backoff / TXBOX_MAX_CALL_BACKOFF must be a duration from 1ms to 1d"}},
		{args: append(relay, "--min-call-backoff", "1m", "--max-call-backoff", "1s"), env: map[string]string{"STRIPE_API_KEY": "sk_test_cli"},
			want: []string{"--max-call-backoff / TXBOX_MAX_CALL_BACKOFF (1s) must be at least --min-call-backoff / TXBOX_MIN_CALL_BACKOFF (1m)"}},
		{args: append(relay, "--stats-interval", "-1s"), want: []string{"--stats-interval / TXBOX_STATS_INTERVAL must be a duration from 1s to 1h"}},
		{args: append(relay, "--max-publish-attempts", "0"), want: []string{"--max-publish-attempts / TXBOX_MAX_PUBLISH_ATTEMPTS must be a whole number from 1 to 1000"}},
		{args: append(relay, "--max-publish-backoff", "25h"), want: []string{"--max-publish-backoff / TXBOX_MAX_PUBLISH_BACKOFF must be a duration from 1ms to 1d"}},
		{args: append(relay, "--min-publish-backoff", "1m", "--max-publish-backoff", "1s"), want: []string{"--max-publish-backoff / TXBOX_MAX_PUBLISH_BACKOFF must be at least 1m"}},

		// outbox.
		{args: []string{"outbox"}, want: []string{"txbox outbox needs a subcommand: bury, list, show"}},
		{args: []string{"outbox", "show", "abc"}, want: []string{`"abc" is not an outbox row id`}},
		{args: []string{"outbox", "bury", "7"}, want: []string{"txbox outbox bury needs --reason"}},
		{args: []string{"outbox", "bury", "7", "--reason", " "}, want: []string{"--reason must not be empty"}},
		{args: []string{"outbox", "list", "--kind", "email"}, want: []string{`--kind must be one of message, call, got "email"`}},
		{args: []string{"outbox", "list", "--limit", "0"}, want: []string{"--limit must be a whole number from 1 to 10000"}},
		{args: []string{"outbox", "list", "--shard", "99"}, want: []string{"--shard 99: the relays' layout has 16 shards, 0 to 15"}},

		// retention.
		{args: []string{"retention"}, want: []string{"--broker-retention / TXBOX_BROKER_RETENTION is required"}},
		{args: []string{"retention", "--broker-retention", "0"}, want: []string{"--broker-retention / TXBOX_BROKER_RETENTION must be a duration from 1m to 3650d"}},
		{args: append(retention, "--every", "1ns"), want: []string{`--every / TXBOX_RETENTION_EVERY must be a duration from 1m to 30d, got "1ns"`}},
		{args: retention, env: map[string]string{"TXBOX_RETENTION_EVERY": "1ns"}, want: []string{"--every / TXBOX_RETENTION_EVERY must be a duration from 1m"}},
		{args: append(retention, "--every", "0"), want: []string{"--every / TXBOX_RETENTION_EVERY must be a duration from 1m"}},
		{args: append(retention, "--inbox-generation", "90s"), want: []string{`--inbox-generation / TXBOX_INBOX_GENERATION must be a duration from 1h to 3650d, got "90s"`}},
		{args: append(retention, "--inbox-retention", "213506d"), want: []string{`--inbox-retention / TXBOX_INBOX_RETENTION must be a duration from 1h to 3650d, written like 90s, 15m, 36h or 7d, got "213506d"`}},
		{args: append(retention, "--inbox-retention", "106752d"), want: []string{"--inbox-retention / TXBOX_INBOX_RETENTION must be a duration"}},
		{args: []string{"retention", "--broker-retention", "15d"}, want: []string{"--inbox-retention / TXBOX_INBOX_RETENTION (15d) must be longer than --broker-retention / TXBOX_BROKER_RETENTION (15d)"}},
		{args: append(retention, "--batch-size", "0"), want: []string{"--batch-size / TXBOX_RETENTION_BATCH_SIZE must be a whole number from 1 to 100000"}},
		{args: append(retention, "--call-result-retention", "-1h"), want: []string{"--call-result-retention / TXBOX_CALL_RESULT_RETENTION must be a duration"}},
		{args: append(retention, "--call-result-retention", "12h"), want: []string{"--call-result-retention / TXBOX_CALL_RESULT_RETENTION must be a duration from 1d"}},

		// dlq.
		{args: []string{"dlq", "list", "--source", "kafka"}, want: []string{`--source must be one of inbox, relay, got "kafka"`}},
		{args: []string{"dlq", "list", "--kind", "email"}, want: []string{`--kind must be one of message, call, got "email"`}},
		{args: []string{"dlq", "list", "--older-than", "yesterday"}, want: []string{"--older-than must be a duration"}},
		{args: []string{"dlq", "list", "--id", "x"}, want: []string{`--id must be letter ids, got "x"`}},
		{args: []string{"dlq", "list", "--limit", "-1"}, want: []string{"--limit must be a whole number from 0"}},
		{args: []string{"dlq", "discard"}, want: []string{"txbox dlq discard needs a filter", "--all"}},
		{args: []string{"dlq", "discard", "--limit", "2"}, want: []string{"needs a filter"}},
		{args: []string{"dlq", "redrive"}, want: []string{"txbox dlq redrive needs a filter"}},
		{args: []string{"dlq", "redrive", "--all", "--rate", "Inf"}, want: []string{`--rate / TXBOX_REDRIVE_RATE must be a number from 0.001 to 100000, got "Inf"`}},
		{args: []string{"dlq", "redrive", "--all", "--rate", "1e309"}, want: []string{"--rate / TXBOX_REDRIVE_RATE must be a number"}},
		{args: []string{"dlq", "redrive", "--all", "--rate", "NaN"}, want: []string{"--rate / TXBOX_REDRIVE_RATE must be a number"}},
		{args: []string{"dlq", "redrive", "--all", "--rate", "0"}, want: []string{"--rate / TXBOX_REDRIVE_RATE must be a number"}},
		{args: []string{"dlq", "redrive", "--all"}, env: map[string]string{"TXBOX_REDRIVE_RATE": "-5"}, want: []string{"--rate / TXBOX_REDRIVE_RATE must be a number"}},
		{args: []string{"dlq", "redrive", "--all", "--burst", "0"}, want: []string{"--burst / TXBOX_REDRIVE_BURST must be a whole number from 1"}},
		{args: []string{"dlq", "redrive", "--all", "--batch-size", "0"}, want: []string{"--batch-size / TXBOX_REDRIVE_BATCH_SIZE must be a whole number from 1"}},
		{args: []string{"dlq", "redrive", "--all", "--burst", "200", "--batch-size", "100"}, want: []string{"--burst / TXBOX_REDRIVE_BURST (200) must not be larger than --batch-size / TXBOX_REDRIVE_BATCH_SIZE (100)"}},
	} {
		name := strings.Join(tc.args, " ")
		for k, v := range tc.env {
			name += " " + k + "=" + v
		}
		t.Run(name, func(t *testing.T) {
			before := e.snapshot(t)
			r := e.txbox(t, tc.env, tc.args...)
			require.Equal(t, 2, r.code, "%s", r)
			for _, want := range tc.want {
				require.Contains(t, r.stderr, want, "%s", r)
			}
			require.Empty(t, r.stdout)
			require.Equal(t, before, e.snapshot(t), "the database changed")
		})
	}
	require.False(t, e.schemaExists(t, typo), "a mistyped schema was created")
}

// Help never shows a secret: the database URL's flag says only that its variable is set.
func TestHelpShowsNoSecret(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	for _, args := range [][]string{
		{"--help"}, {"help", "relay"}, {"relay", "--help"}, {"relay", "-h"}, {"migrate", "up", "--help"}, {"migrate", "--help"},
		{"dlq", "show", "--help"}, {"dlq", "redrive", "--help"}, {"retention", "--help"}, {"status", "--help"},
	} {
		r := e.txbox(t, nil, args...)
		require.Zero(t, r.code, "%v\n%s", args, r)
		require.Contains(t, r.stdout, "Usage:", args)
	}
	r := e.txbox(t, nil, "relay", "--help")
	require.Contains(t, r.stdout, "[$TXBOX_DATABASE_URL is set]")
	require.Contains(t, r.stdout, "[$TXBOX_SHARDS]")
	require.Contains(t, r.stdout, "(default 25ms)")
	require.NotContains(t, r.stdout, "STRIPE_API_KEY]", "the Stripe key has no flag")
}

// A database txbox cannot reach is named by its setting, whichever command met it, and its
// password is not shown.
func TestUnreachableDatabaseNamesTheSetting(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	unreachable := withPassword(t, "postgres://postgres@127.0.0.1:1/txbox?connect_timeout=5", e.password)
	for _, args := range [][]string{{"relay", "--kafka-brokers", "127.0.0.1:1"}, {"status"}, {"dlq", "list"}, {"outbox", "list"}, {"migrate", "up"}, {"migrate", "status"}} {
		r := e.txbox(t, map[string]string{"TXBOX_DATABASE_URL": unreachable}, args...)
		require.Equal(t, 1, r.code, "%v\n%s", args, r)
		require.Contains(t, r.stderr, "--database-url / TXBOX_DATABASE_URL: cannot reach PostgreSQL", "%v\n%s", args, r)
	}
}

// A setting whose default follows another's (relay.Config's IdlePollInterval, MaxPublishBackoff and
// CallConfig.MaxBackoff are at least the setting they follow) follows it on the command line too:
// given alone, the other is accepted, and the command goes on to connect. Before, --poll-interval
// 50ms alone was refused for the idle interval's 25ms default.
func TestDefaultsFollowTheSettingsTheyDependOn(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	unreachable := withPassword(t, "postgres://postgres@127.0.0.1:1/txbox?connect_timeout=5", e.password)
	for _, given := range [][]string{{"--poll-interval", "50ms"}, {"--min-publish-backoff", "10m"}, {"--min-call-backoff", "10m"}} {
		args := append([]string{"relay", "--kafka-brokers", "127.0.0.1:1", "--metrics-addr", "off"}, given...)
		r := e.txbox(t, map[string]string{"TXBOX_DATABASE_URL": unreachable, "STRIPE_API_KEY": "sk_test_cli"}, args...)
		require.Equal(t, 1, r.code, "%v\n%s", given, r)
		require.Contains(t, r.stderr, "cannot reach PostgreSQL", "%v: past the settings' checks\n%s", given, r)
	}
}

// silentServer listens on a port of its own, takes every connection and never answers, until the
// test ends; it returns the address.
func silentServer(t *testing.T) string {
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var held []net.Conn
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			conn, err := silent.Accept()
			if err != nil {
				return
			}
			held = append(held, conn)
		}
	}()
	t.Cleanup(func() {
		_ = silent.Close()
		<-accepted
		for _, c := range held {
			_ = c.Close()
		}
	})
	return silent.Addr().String()
}

// A server that takes the connection and never answers (hung, or another program on its port) is
// unreachable too: without connect_timeout in the URL, a command waited for it for ever at start.
func TestADatabaseThatNeverAnswersIsUnreachable(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	hung := withPassword(t, "postgres://postgres@"+silentServer(t)+"/txbox", e.password)
	for _, args := range [][]string{{"relay", "--kafka-brokers", "127.0.0.1:1", "--metrics-addr", "off"}, {"migrate", "up"}} {
		t.Run(args[0], func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // Far above the default connect timeout.
			defer cancel()
			r := e.exec(ctx, nil, map[string]string{"TXBOX_DATABASE_URL": hung}, args...)
			e.requireNoSecret(t, r)
			require.NoError(t, ctx.Err(), "the command gave up before being stopped\n%s", r)
			require.Equal(t, 1, r.code, "%s", r)
			require.Contains(t, r.stderr, "--database-url / TXBOX_DATABASE_URL: cannot reach PostgreSQL", "%s", r)
		})
	}
	// pgx gives each host of a URL connect_timeout of its own: the start-up check bounded them all
	// by twice that, and refused a healthy primary listed after hung standbys.
	t.Run("healthy host after hung ones", func(t *testing.T) {
		t.Parallel()
		healthy, err := pgconn.ParseConfig(e.URL)
		require.NoError(t, err)
		var hosts, ports []string
		for range 3 { // pgx tries a host and port listed twice once.
			host, port, err := net.SplitHostPort(silentServer(t))
			require.NoError(t, err)
			hosts, ports = append(hosts, host), append(ports, port)
		}
		dsn := fmt.Sprintf("host=%s,%s port=%s,%d user=%s dbname=%s password=%s connect_timeout=1 sslmode=disable",
			strings.Join(hosts, ","), healthy.Host, strings.Join(ports, ","), healthy.Port, healthy.User, healthy.Database, e.password)
		r := e.txbox(t, map[string]string{"TXBOX_DATABASE_URL": dsn}, "migrate", "status")
		require.Zero(t, r.code, "%s", r)
	})
}

func TestVersionAndCompletion(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	r := e.txbox(t, nil, "version")
	require.Zero(t, r.code, r)
	require.Regexp(t, `^txbox \S+\n(revision \S+.*\n)?built with go1\.\d+`, r.stdout)
	for _, shell := range []string{"bash", "zsh", "fish"} {
		r := e.txbox(t, nil, "completion", shell)
		require.Zero(t, r.code, r)
		require.Contains(t, r.stdout, "txbox", shell)
		require.Greater(t, len(r.stdout), 1000, shell)
	}
}

// The README's first command: flags after the subcommand, into a schema that does not exist yet.
func TestMigrateUpIntoANewSchema(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	schema := e.Schema + "_new"
	e.dropSchemaLater(t, schema)
	r := e.txbox(t, map[string]string{"TXBOX_DATABASE_URL": "", "TXBOX_SCHEMA": ""},
		"migrate", "up", "--database-url", e.vars["TXBOX_DATABASE_URL"], "--schema", schema)
	require.Zero(t, r.code, r)
	require.Contains(t, r.stdout, "applied 00001_txbox.sql")
	require.Contains(t, e.tables(t, schema), "txbox_outbox")

	r = e.txbox(t, map[string]string{"TXBOX_SCHEMA": schema}, "migrate", "up")
	require.Zero(t, r.code, r)
	require.Equal(t, "schema "+schema+" is up to date\n", r.stdout)

	r = e.txbox(t, nil, "migrate", "status", "--schema", schema)
	require.Zero(t, r.code, r)
	require.Regexp(t, `00001_txbox.sql\s+applied \d{4}-`, r.stdout)
}

// A schema that lacks this binary's latest migrations is refused before anything runs, naming
// them and the command that applies them; before, the commands warned and then failed in the
// middle of work on a missing column.
func TestCommandsRefuseASchemaThatLacksMigrations(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	schema := e.Schema + "_old"
	e.dropSchemaLater(t, schema)
	db := stdlib.OpenDBFromPool(e.Pool)
	defer db.Close()
	p, err := migrations.NewProvider(context.Background(), db, migrations.WithSchema(schema))
	require.NoError(t, err)
	sources := p.ListSources()
	latest := sources[len(sources)-1].Version
	_, err = p.UpTo(context.Background(), sources[len(sources)-2].Version)
	require.NoError(t, err)

	for _, args := range [][]string{{"status"}, {"dlq", "list"}, {"relay", "--kafka-brokers", "127.0.0.1:1"}} {
		r := e.txbox(t, map[string]string{"TXBOX_SCHEMA": schema}, args...)
		require.Equal(t, 2, r.code, "%v: %v", args, r)
		require.Contains(t, r.stderr, fmt.Sprintf("lacks migrations [%d]", latest), args)
		require.Contains(t, r.stderr, "run: txbox migrate up --schema "+schema, args)
	}
	r := e.txbox(t, map[string]string{"TXBOX_SCHEMA": schema}, "migrate", "up")
	require.Zero(t, r.code, r)
	r = e.txbox(t, map[string]string{"TXBOX_SCHEMA": schema}, "status")
	require.Zero(t, r.code, r)
}

// Several `txbox migrate up` at once on a schema that does not exist yet all succeed.
func TestConcurrentMigrateUp(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	for round := range 3 {
		schema := fmt.Sprintf("%s_c%d", e.Schema, round)
		e.dropSchemaLater(t, schema)
		results := make([]result, 4)
		var wg sync.WaitGroup
		for i := range results {
			wg.Go(func() { results[i] = e.exec(context.Background(), nil, nil, "migrate", "up", "--schema", schema) })
		}
		wg.Wait()
		for _, r := range results {
			e.requireNoSecret(t, r)
			require.Zero(t, r.code, "round %d: %s", round, r)
		}
		require.Contains(t, e.tables(t, schema), "txbox_outbox")
	}
}

// migrate down refuses to drop messages nobody has published or looked at, unless --force.
func TestMigrateDownRefusesWhileMessagesRemain(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	ctx := context.Background()
	_, err := e.Pool.Exec(ctx, `INSERT INTO `+e.Q("txbox_outbox")+` (kind, slot, topic, partition_key, uuid, payload) VALUES ('message', 0, 't', 'k', 'u-1', '')`)
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `INSERT INTO `+e.Q("txbox_dlq")+` (source, kind, topic, uuid, payload, reason) SELECT 'relay', 'message', 't', 'u-' || g, '', 'r' FROM generate_series(1, 3) g`)
	require.NoError(t, err)
	before := e.snapshot(t)

	r := e.txbox(t, nil, "migrate", "down")
	require.Equal(t, 1, r.code, r)
	require.Contains(t, r.stderr, "refusing to roll back schema "+e.Schema+": it holds 1 outbox row(s) not yet published and 3 dead letter(s)")
	require.Contains(t, r.stderr, "--force")
	require.Equal(t, before, e.snapshot(t), "nothing was dropped")

	r = e.txbox(t, nil, "migrate", "down", "--force")
	require.Zero(t, r.code, r)
	require.Contains(t, r.stdout, "rolled back 00001_txbox.sql")
	require.Equal(t, []string{"txbox_goose_db_version"}, e.tables(t, e.Schema))

	r = e.txbox(t, nil, "migrate", "status")
	require.Zero(t, r.code, r)
	require.Contains(t, r.stdout, "00001_txbox.sql                       pending\n", "aligned with the longest name")
	require.Contains(t, r.stdout, "00013_lease_tokens_from_the_clock.sql pending\n")
	require.Contains(t, r.stdout, "txbox is not installed in schema "+e.Schema)
}

// Stored text reaches the operator's terminal with its control characters escaped; --json stays
// exact.
func TestDLQOutputIsSanitised(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	w, err := dlq.NewWriter(e.Schema)
	require.NoError(t, err)
	const (
		payload = "{\"x\":1}\x1b]0;owned\x07\x1b[2J\r\u202eevil"
		errText = "boom\x1b[31m red\nline two\u009b"
		topic   = "orders\x1b[1A"
	)
	require.NoError(t, w.Add(context.Background(), e.Pool, dlq.Entry{
		Source: dlq.SourceInbox, Consumer: "billing\a", DedupKey: "k-1", UUID: "m-1", Topic: topic,
		Reason: "bad\tinput\x1b[0m", Payload: []byte(payload), Error: errText, Metadata: map[string]string{"h\x1b": "v\x1b"},
	}))
	var id int64
	require.NoError(t, e.Pool.QueryRow(context.Background(), `SELECT max(id) FROM `+e.Q("txbox_dlq")).Scan(&id))

	for _, args := range [][]string{{"dlq", "list"}, {"dlq", "show", fmt.Sprint(id)}, {"dlq", "redrive", "--all", "--dry-run"}} {
		r := e.txbox(t, nil, args...)
		require.Zero(t, r.code, "%v\n%s", args, r)
		for _, c := range []string{"\x1b", "\x07", "\r", "\u202e", "\x9b", "\a"} {
			require.NotContains(t, r.stdout, c, "%v prints a raw control character %q", args, c)
		}
		require.Contains(t, r.stdout, `orders\x1b[1A`, args)
	}
	r := e.txbox(t, nil, "dlq", "show", fmt.Sprint(id))
	require.Contains(t, r.stdout, `\x1b]0;owned\x07\x1b[2J\r\u202eevil`)
	require.Contains(t, r.stdout, "  boom\\x1b[31m red\n  line two\\u009b", "newlines of multi-line fields are kept")
	require.Contains(t, r.stdout, `h\x1b: v\x1b`)

	r = e.txbox(t, nil, "dlq", "show", fmt.Sprint(id), "--json")
	require.Zero(t, r.code, r)
	var got letterJSON
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &got))
	require.Equal(t, payload, *got.Payload)
	require.Equal(t, errText, got.Error)
	require.Equal(t, topic, got.Topic)
	r = e.txbox(t, nil, "dlq", "list", "--json")
	require.Zero(t, r.code, r)
	require.Contains(t, r.stdout, `"topic": "orders\u001b[1A"`, "JSON escapes, exactly")
}

// One start line with the effective configuration, secrets redacted, in the format and at the
// level asked for.
func TestStartLine(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	r := e.txbox(t, nil, "retention", "--broker-retention", "7d", "--log-format", "json")
	require.Zero(t, r.code, r)
	var start map[string]any
	for line := range strings.SplitSeq(strings.TrimSpace(r.stderr), "\n") {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), line)
		if m["msg"] == "txbox retention starting" {
			start = m
		}
	}
	require.NotNil(t, start, r.stderr)
	require.Equal(t, "INFO", start["level"])
	require.Equal(t, "7d", start["broker_retention"])
	require.Equal(t, "15d", start["inbox_retention"])
	require.Equal(t, e.Schema, start["schema"])
	u, err := url.Parse(start["database_url"].(string))
	require.NoError(t, err)
	_, hasPassword := u.User.Password()
	require.False(t, hasPassword)

	r = e.txbox(t, map[string]string{"TXBOX_LOG_LEVEL": "warn"}, "retention", "--broker-retention", "7d")
	require.Zero(t, r.code, r)
	require.NotContains(t, r.stderr, "starting")
}

// The relay logs its start line, with the owner it resolved, says it is ready at /readyz once it
// runs, and stops cleanly on cancellation. A second relay with another shard count is refused by
// the library; the message names the flag.
func TestRelayStartsAndStops(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Metrics off through the environment: a deployment configured only by variables cannot give
	// the flag's empty value (an empty variable is refused).
	kafka := map[string]string{"TXBOX_KAFKA_BROKERS": strings.Join(kafkatest.Brokers(t), ","), "TXBOX_METRICS_ADDR": "off"}
	relayArgs := func(extra ...string) []string {
		return append([]string{"relay", "--transactional-id-prefix", e.Schema, "--lease-ttl", "1s"}, extra...)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	metricsAddr := ln.Addr().String()
	require.NoError(t, ln.Close())
	var stderr proctest.Buffer
	done := make(chan result, 1)
	go func() {
		done <- e.exec(ctx, &stderr, kafka, relayArgs("--shards", "2", "--owner", "cli-test", "--metrics-addr", metricsAddr)...)
	}()
	require.Eventually(t, func() bool {
		var held int
		require.NoError(t, e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+e.Q("txbox_lease")+` WHERE owner = 'cli-test' AND expires_at > now()`).Scan(&held))
		return held > 0
	}, 30*time.Second, 10*time.Millisecond, "the relay takes leases")
	readyz := func() (int, string) {
		res, err := http.Get("http://" + metricsAddr + "/readyz")
		if err != nil {
			return 0, err.Error()
		}
		defer res.Body.Close()
		body, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(body)
	}
	require.Eventually(t, func() bool { code, _ := readyz(); return code == http.StatusOK }, 30*time.Second, 10*time.Millisecond)
	var named int
	require.NoError(t, e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'txbox relay'`).Scan(&named))
	require.Positive(t, named, "the relay's sessions are named in pg_stat_activity")
	_, body := readyz()
	require.Equal(t, "ready\n", body)

	other := e.txbox(t, kafka, relayArgs("--shards", "4")...)
	require.Equal(t, 1, other.code, other)
	require.Contains(t, other.stderr, "--shards / TXBOX_SHARDS is 4 but running relays hold leases of a 2-shard layout")
	require.NotContains(t, other.stderr, "Config.")
	other = e.txbox(t, kafka, relayArgs("--shards", "2", "--transactional-id-prefix", "elsewhere")...)
	require.Equal(t, 1, other.code, other)
	require.Contains(t, other.stderr, `--transactional-id-prefix / TXBOX_TRANSACTIONAL_ID_PREFIX is "elsewhere" but running relay "cli-test" publishes with "`+e.Schema+`"`)

	cancel()
	select {
	case r := <-done:
		e.requireNoSecret(t, r)
		require.Zero(t, r.code, r)
		require.Regexp(t, `msg="txbox relay starting" .*database_url=postgres://\S+@`, r.stderr)
		require.Contains(t, r.stderr, "owner=cli-test")
		require.Equal(t, 1, strings.Count(r.stderr, " owner="), "the owner is logged once:\n%s", r.stderr)
		require.Contains(t, r.stderr, "shards=2")
		require.Contains(t, r.stderr, "call_timeout=666.666666ms", "the resolved default")
		require.Contains(t, r.stderr, "side_effect_calls=false")
	case <-time.After(30 * time.Second):
		t.Fatal("the relay did not stop")
	}
}
