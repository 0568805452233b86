package main

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/proctest"
)

var consoleURL = regexp.MustCompile(`msg="console listening" url=(http://\S+/)`)

// txbox console serves until it is stopped, says where, logs its mode, never the token; a token
// too short or an address that is not host:port are usage errors.
func TestConsoleCommand(t *testing.T) {
	t.Parallel()
	e := newCLIEnv(t)
	const token = "console-token-for-the-cli-test"

	short := e.txbox(t, map[string]string{consoleTokenEnv: "hunter2"}, "console", "--addr", "127.0.0.1:0")
	require.Equal(t, 2, short.code, short)
	require.Contains(t, short.stderr, "TXBOX_CONSOLE_TOKEN must be at least 16 characters long (the value is not shown)")
	require.NotContains(t, short.stderr, "hunter2")
	bad := e.txbox(t, nil, "console", "--addr", "9465")
	require.Equal(t, 2, bad.code, bad)
	require.Contains(t, bad.stderr, `--addr / TXBOX_CONSOLE_ADDR must be host:port, got "9465"`)

	for _, tc := range []struct {
		env  map[string]string
		args []string
		mode string
	}{
		{env: map[string]string{consoleTokenEnv: token}, mode: `mode="operators sign in with TXBOX_CONSOLE_TOKEN"`},
		{env: map[string]string{consoleTokenEnv: token, "TXBOX_CONSOLE_READ_ONLY": "true"}, mode: "mode=read-only"},
		{args: []string{"--read-only"}, mode: "mode=read-only"},
		{mode: `mode="read-only: TXBOX_CONSOLE_TOKEN is not set"`},
	} {
		ctx, cancel := context.WithCancel(context.Background())
		var stderr proctest.Buffer
		done := make(chan result, 1)
		go func() {
			done <- e.exec(ctx, &stderr, tc.env, append([]string{"console", "--addr", "127.0.0.1:0"}, tc.args...)...)
		}()
		var url string
		require.Eventually(t, func() bool {
			m := consoleURL.FindStringSubmatch(stderr.String())
			if m != nil {
				url = m[1]
			}
			return m != nil
		}, 30*time.Second, 10*time.Millisecond, "the console says where it listens:\n%s", &stderr)
		res, err := http.Get(url + "login")
		require.NoError(t, err)
		body, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		require.NoError(t, res.Body.Close())
		require.Equal(t, http.StatusOK, res.StatusCode)
		require.Equal(t, tc.mode != `mode="operators sign in with TXBOX_CONSOLE_TOKEN"`, regexp.MustCompile(`This console is read-only`).Match(body))
		cancel()
		select {
		case r := <-done:
			e.requireNoSecret(t, r)
			require.Zero(t, r.code, r)
			require.Contains(t, r.stderr, `msg="txbox console starting"`)
			require.Contains(t, r.stderr, tc.mode)
			require.Contains(t, r.stderr, "addr=127.0.0.1:0")
			require.Contains(t, r.stderr, "console stopped")
			require.NotContains(t, r.stderr, token)
			require.NotContains(t, r.stdout, token)
		case <-time.After(30 * time.Second):
			t.Fatal("the console did not stop")
		}
	}
}
