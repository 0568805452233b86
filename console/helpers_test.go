package console_test

import (
	"bytes"
	"context"
	"encoding/json"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/console"
	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/internal/txtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// testToken is the operator token of the tests' consoles.
const testToken = "correct-horse-battery-staple-42"

// bundle is one test's console over a migrated schema, served by httptest.
type bundle struct {
	env  *txtest.Env
	srv  *console.Server
	ts   *httptest.Server
	logs *syncBuffer
}

// syncBuffer collects the console's log lines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func setup(t *testing.T, mutate func(*console.Config)) *bundle {
	t.Helper()
	env := txtest.New(t)
	return setupIn(t, env, mutate)
}

func setupIn(t *testing.T, env *txtest.Env, mutate func(*console.Config)) *bundle {
	t.Helper()
	logs := &syncBuffer{}
	cfg := console.Config{DB: env.Pool, Schema: env.Schema, Token: testToken, Logger: slog.New(slog.NewTextHandler(logs, nil))}
	if mutate != nil {
		mutate(&cfg)
	}
	srv, err := console.New(cfg)
	require.NoError(t, err)
	require.NoError(t, srv.Check(context.Background()))
	ts := httptest.NewServer(srv)
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
	})
	return &bundle{env: env, srv: srv, ts: ts, logs: logs}
}

// browser is an HTTP client with its own cookies, like one browser.
type browser struct {
	t      *testing.T
	b      *bundle
	client *http.Client
}

func (b *bundle) browser(t *testing.T) *browser {
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	return &browser{t: t, b: b, client: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}}
}

// page is a response, its body read.
type page struct {
	status int
	header http.Header
	body   string
}

func (br *browser) do(req *http.Request) page {
	br.t.Helper()
	res, err := br.client.Do(req)
	require.NoError(br.t, err)
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	require.NoError(br.t, err)
	return page{status: res.StatusCode, header: res.Header, body: string(body)}
}

func (br *browser) get(path string) page {
	br.t.Helper()
	req, err := http.NewRequest(http.MethodGet, br.b.ts.URL+path, nil)
	require.NoError(br.t, err)
	return br.do(req)
}

// post sends a form as a page of the console would: with the console's Origin, unless headers
// say otherwise (an empty value removes a header).
func (br *browser) post(path string, form url.Values, headers map[string]string) page {
	br.t.Helper()
	req, err := http.NewRequest(http.MethodPost, br.b.ts.URL+path, strings.NewReader(form.Encode()))
	require.NoError(br.t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", br.b.ts.URL)
	for k, v := range headers {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	return br.do(req)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// csrf returns the CSRF token a page's forms carry.
func (br *browser) csrf(p page) string {
	br.t.Helper()
	m := csrfField.FindStringSubmatch(p.body)
	require.NotNil(br.t, m, "the page has no CSRF field:\n%s", p.body)
	return html.UnescapeString(m[1])
}

var upToField = regexp.MustCompile(`name="upto" value="(\d+)"`)

// upTo returns the highest letter id a letters page's discard form is bounded by.
func (br *browser) upTo(p page) string {
	br.t.Helper()
	m := upToField.FindStringSubmatch(p.body)
	require.NotNil(br.t, m, "the page has no discard form:\n%s", p.body)
	return m[1]
}

// signIn signs in as name with token and returns the session's CSRF token.
func (br *browser) signIn(name, token string) (page, string) {
	br.t.Helper()
	form := url.Values{"csrf": {br.csrf(br.get("/login"))}, "operator": {name}, "token": {token}, "next": {"/letters"}}
	res := br.post("/login", form, nil)
	if res.status != http.StatusSeeOther {
		return res, ""
	}
	return res, br.csrf(br.get("/letters"))
}

func (br *browser) mustSignIn(name string) string {
	br.t.Helper()
	res, csrf := br.signIn(name, testToken)
	require.Equal(br.t, http.StatusSeeOther, res.status, res.body)
	return csrf
}

func (br *browser) getJSON(path string, v any) {
	br.t.Helper()
	p := br.get(path)
	require.Equal(br.t, http.StatusOK, p.status, p.body)
	require.NoError(br.t, json.Unmarshal([]byte(p.body), v))
}

// addLetter writes a dead letter the way the components do, through dlq.Writer.
func (b *bundle) addLetter(t *testing.T, e dlq.Entry) int64 {
	t.Helper()
	ctx := context.Background()
	w, err := dlq.NewWriter(b.env.Schema)
	require.NoError(t, err)
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, w.Add(ctx, tx, e))
	var id int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT max(id) FROM `+b.env.Q("txbox_dlq")).Scan(&id))
	require.NoError(t, tx.Commit(ctx))
	return id
}

func (b *bundle) count(t *testing.T, table, where string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+b.env.Q(table)+` WHERE `+where, args...).Scan(&n))
	return n
}

type auditRow struct {
	Operator, Action, Target, Detail, Result string
}

func (b *bundle) audit(t *testing.T) []auditRow {
	t.Helper()
	rows, err := b.env.Pool.Query(context.Background(), `SELECT operator, action, target, detail, result FROM `+
		b.env.Q("txbox_console_audit")+` ORDER BY id`)
	require.NoError(t, err)
	defer rows.Close()
	var out []auditRow
	for rows.Next() {
		var r auditRow
		require.NoError(t, rows.Scan(&r.Operator, &r.Action, &r.Target, &r.Detail, &r.Result))
		out = append(out, r)
	}
	require.NoError(t, rows.Err())
	return out
}
