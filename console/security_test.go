package console_test

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/console"
	"github.com/txbox/txbox/dlq"
)

func TestEveryResponseCarriesTheSecurityHeaders(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	br := b.browser(t)
	id := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: "m-1", Reason: "boom"})
	for _, path := range []string{"/", "/api/status", "/letters", "/letters/" + strconv.FormatInt(id, 10), "/letters/999999",
		"/outbox", "/calls", "/audit", "/login", "/redrives", "/static/console.js", "/static/console.css", "/no/such/page"} {
		res := br.get(path)
		require.NotEqual(t, http.StatusInternalServerError, res.status, path)
		h := res.header
		require.Equal(t, "DENY", h.Get("X-Frame-Options"), path)
		require.Equal(t, "nosniff", h.Get("X-Content-Type-Options"), path)
		require.Equal(t, "no-store", h.Get("Cache-Control"), path)
		csp := h.Get("Content-Security-Policy")
		require.Contains(t, csp, "script-src 'self'", path)
		require.Contains(t, csp, "frame-ancestors 'none'", path)
		require.NotContains(t, csp, "unsafe-inline", path)
		require.NotContains(t, csp, "unsafe-eval", path)
	}
	res := br.post("/letters/discard", url.Values{"id": {"1"}}, nil)
	require.Equal(t, "DENY", res.header.Get("X-Frame-Options"))
	require.Equal(t, "no-store", res.header.Get("Cache-Control"))
}

// The pages carry no inline script or style, so the CSP needs no exception for them.
func TestPagesHaveNoInlineScriptOrStyle(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	br := b.browser(t)
	br.mustSignIn("alice")
	id := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: "m-1", Reason: "boom"})
	for _, path := range []string{"/", "/letters", "/letters/" + strconv.FormatInt(id, 10), "/letters/redrive?consumer=billing",
		"/outbox", "/calls", "/audit", "/redrives"} {
		body := br.get(path).body
		require.Equal(t, 1, strings.Count(body, "<script"), path)
		require.Contains(t, body, `<script src="/static/console.js" defer></script>`, path)
		require.NotContains(t, body, "<style", path)
		require.NotContains(t, body, " style=", path)
		require.NotRegexp(t, ` on[a-z]+=`, body, path)
	}
}

func TestRequestsForOtherHostNamesAreRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *console.Config) { c.AllowedHosts = []string{"console.internal"} })
	br := b.browser(t)
	for host, want := range map[string]int{
		"evil.example":           http.StatusMisdirectedRequest, // a page that rebound its name to 127.0.0.1
		"evil.example:8080":      http.StatusMisdirectedRequest,
		"localhost.evil.example": http.StatusMisdirectedRequest,
		"localhost":              http.StatusOK,
		"LOCALHOST:9465":         http.StatusOK,
		"127.0.0.1:9465":         http.StatusOK,
		"[::1]:9465":             http.StatusOK,
		"console.internal":       http.StatusOK,
		"console.internal:443":   http.StatusOK,
	} {
		req, err := http.NewRequest(http.MethodGet, b.ts.URL+"/letters", nil)
		require.NoError(t, err)
		req.Host = host
		require.Equal(t, want, br.do(req).status, host)
	}
}

func TestWithoutATokenTheConsoleIsReadOnly(t *testing.T) {
	t.Parallel()
	for name, mutate := range map[string]func(*console.Config){
		"no token":  func(c *console.Config) { c.Token = "" },
		"read-only": func(c *console.Config) { c.ReadOnly = true },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, mutate)
			require.False(t, b.srv.CanChange())
			id := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: "m-1", Reason: "boom"})
			br := b.browser(t)
			login := br.get("/login")
			require.Contains(t, login.body, "This console is read-only")
			require.NotContains(t, login.body, `name="token"`)
			require.Contains(t, br.get("/letters").body, `id="mode">read-only`)
			require.NotContains(t, br.get("/letters/"+strconv.FormatInt(id, 10)).body, "/letters/discard", "no form offers a change")

			res := br.post("/login", url.Values{"operator": {"alice"}, "token": {testToken}}, nil)
			require.Equal(t, http.StatusForbidden, res.status)
			for _, path := range []string{"/letters/discard", "/letters/redrive", "/outbox/1/bury", "/redrives/1/stop", "/logout"} {
				res := br.post(path, url.Values{"id": {strconv.FormatInt(id, 10)}, "expect": {"1"}, "reason": {"x"}}, nil)
				require.Equal(t, http.StatusForbidden, res.status, path)
				require.Contains(t, res.body, "read-only", path)
			}
			require.Equal(t, 1, b.count(t, "txbox_dlq", "true"))
			require.Empty(t, b.audit(t))
		})
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for want, cfg := range map[string]console.Config{
		"Config.DB is required":     {},
		"Config.Schema":             {DB: b.env.Pool, Schema: "No Such"},
		"at least 16 bytes":         {DB: b.env.Pool, Token: "short"},
		"Config.AllowedHosts":       {DB: b.env.Pool, AllowedHosts: []string{"host:80"}},
		"Config.SessionTTL":         {DB: b.env.Pool, SessionTTL: 1},
		"Config.Refresh":            {DB: b.env.Pool, Refresh: 1},
		"Config.Window must not be": {DB: b.env.Pool, Window: -1},
	} {
		_, err := console.New(cfg)
		require.ErrorContains(t, err, want)
	}
	_, err := console.New(console.Config{DB: b.env.Pool, Token: "short"})
	require.ErrorIs(t, err, console.ErrTokenTooShort)
	require.NotContains(t, err.Error(), "short\"")

	// A console that can change things needs the audit table; a read-only one does not.
	_, err = b.env.Pool.Exec(context.Background(), `DROP TABLE `+b.env.Q("txbox_console_audit"))
	require.NoError(t, err)
	require.ErrorIs(t, b.srv.Check(context.Background()), console.ErrNotMigrated)
	readOnly, err := console.New(console.Config{DB: b.env.Pool, Schema: b.env.Schema})
	require.NoError(t, err)
	require.NoError(t, readOnly.Check(context.Background()))
}

// Signing in needs the token, compared in constant time; the token is never logged or echoed,
// and refusals are audited and logged with the name given.
func TestSignInNeedsTheToken(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	br := b.browser(t)
	const wrong = "wrong-token-guess-0123456789"
	res, _ := br.signIn("mallory", wrong)
	require.Equal(t, http.StatusForbidden, res.status)
	require.Contains(t, res.body, "Wrong token.")
	require.Contains(t, res.body, `value="mallory"`, "the name is kept for the next try")
	require.NotContains(t, res.body, wrong)
	require.NotContains(t, res.body, `id="operator"`, "not signed in")

	res, _ = br.signIn("", testToken)
	require.Equal(t, http.StatusBadRequest, res.status)
	res, _ = br.signIn("alice\x1b[2J", testToken)
	require.Equal(t, http.StatusBadRequest, res.status, "a name that would rewrite a terminal is refused")

	res, csrf := br.signIn("alice", testToken)
	require.Equal(t, http.StatusSeeOther, res.status)
	require.Equal(t, "/letters", res.header.Get("Location"))
	require.NotEmpty(t, csrf)
	var cookie *http.Cookie
	for _, c := range (&http.Response{Header: res.header}).Cookies() {
		if c.Name == "txbox_console" && c.Value != "" {
			cookie = c
		}
	}
	require.NotNil(t, cookie)
	require.True(t, cookie.HttpOnly)
	require.Equal(t, http.SameSiteStrictMode, cookie.SameSite)
	require.NotContains(t, cookie.Value, testToken)
	page := br.get("/letters")
	require.Contains(t, page.body, `<span id="operator">alice</span>`)
	require.NotContains(t, page.body, testToken)

	require.Equal(t, []auditRow{
		{Operator: "mallory", Action: "sign in", Target: "console", Result: "refused: wrong token"},
		{Operator: "alice", Action: "sign in", Target: "console", Result: "ok"},
	}, b.audit(t))
	logs := b.logs.String()
	require.Contains(t, logs, "sign-in refused")
	require.Contains(t, logs, "operator=mallory")
	require.NotContains(t, logs, testToken)
	require.NotContains(t, logs, wrong)

	// A session cookie is good only with its signature.
	tampered := b.browser(t)
	u, _ := url.Parse(b.ts.URL)
	id, _, _ := strings.Cut(cookie.Value, ".")
	tampered.client.Jar.SetCookies(u, []*http.Cookie{{Name: "txbox_console", Value: id + ".AAAA"}})
	require.NotContains(t, tampered.get("/letters").body, `id="operator"`)
	tampered.client.Jar.SetCookies(u, []*http.Cookie{{Name: "txbox_console", Value: id}})
	require.NotContains(t, tampered.get("/letters").body, `id="operator"`)

	// Signing out ends the session on the server, not only in the browser.
	stolen := cookie.Value
	require.Equal(t, http.StatusSeeOther, br.post("/logout", url.Values{"csrf": {csrf}}, nil).status)
	replay := b.browser(t)
	replay.client.Jar.SetCookies(u, []*http.Cookie{{Name: "txbox_console", Value: stolen}})
	require.NotContains(t, replay.get("/letters").body, `id="operator"`)
}

func TestSignInFormIsCSRFProtectedAndRateLimited(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	br := b.browser(t)
	csrf := br.csrf(br.get("/login"))
	form := url.Values{"operator": {"alice"}, "token": {testToken}}
	require.Equal(t, http.StatusForbidden, br.post("/login", form, nil).status, "no CSRF token")
	form.Set("csrf", csrf)
	require.Equal(t, http.StatusForbidden, br.post("/login", form, map[string]string{"Origin": "http://evil.example"}).status)
	require.Equal(t, http.StatusForbidden, b.browser(t).post("/login", form, nil).status, "another browser's token")

	// Guessing is paced: after the burst, every attempt waits for the rate, the right one too.
	console.SetSignInLimit(b.srv, rate.Every(time.Hour), 3)
	form.Set("token", "wrong-token-guess-0123456789")
	for range 3 {
		require.Equal(t, http.StatusForbidden, br.post("/login", form, nil).status)
	}
	require.Equal(t, http.StatusTooManyRequests, br.post("/login", form, nil).status)
	form.Set("token", testToken)
	res := br.post("/login", form, nil)
	require.Equal(t, http.StatusTooManyRequests, res.status)
	require.Contains(t, res.body, "Too many sign-in attempts")
	require.Len(t, b.audit(t), 3, "attempts refused by the limit never compare the token")
}

// Every change needs a signed-in session, that session's CSRF token and an Origin (or Referer)
// naming the console.
func TestChangesNeedSessionCSRFTokenAndOrigin(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	id := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: "m-1", Reason: "boom"})
	alice := b.browser(t)
	csrf := alice.mustSignIn("alice")
	other := b.browser(t)
	otherCSRF := other.mustSignIn("bob")
	require.NotEqual(t, csrf, otherCSRF)
	discard := func(token string) url.Values {
		return url.Values{"csrf": {token}, "id": {strconv.FormatInt(id, 10)}, "expect": {"1"}}
	}

	anonymous := b.browser(t)
	require.Equal(t, http.StatusForbidden, anonymous.post("/letters/discard", discard(csrf), nil).status, "not signed in")
	require.Equal(t, http.StatusForbidden, alice.post("/letters/discard", discard(""), nil).status, "no token")
	require.Equal(t, http.StatusForbidden, alice.post("/letters/discard", discard(otherCSRF), nil).status, "bob's token")
	require.Equal(t, http.StatusForbidden, alice.post("/letters/discard", discard(csrf), map[string]string{"Origin": "http://evil.example"}).status)
	require.Equal(t, http.StatusForbidden, alice.post("/letters/discard", discard(csrf), map[string]string{"Origin": "null"}).status)
	require.Equal(t, http.StatusForbidden, alice.post("/letters/discard", discard(csrf), map[string]string{"Origin": ""}).status,
		"neither Origin nor Referer")
	require.Equal(t, http.StatusForbidden, alice.post("/letters/discard", discard(csrf),
		map[string]string{"Origin": "", "Referer": "http://evil.example/letters"}).status)
	require.Equal(t, 1, b.count(t, "txbox_dlq", "true"), "nothing refused was discarded")
	// The refusals of alice's session are audited (a page of another site posting through her
	// browser shows there); the anonymous one is only logged.
	var refused []auditRow
	for _, row := range b.audit(t) {
		if strings.HasPrefix(row.Result, "refused: ") {
			refused = append(refused, row)
		}
	}
	require.Len(t, refused, 6, "%+v", refused)
	for _, row := range refused {
		require.Equal(t, "alice", row.Operator)
		require.Equal(t, "POST /letters/discard", row.Action)
	}
	require.Contains(t, refused[0].Result, "CSRF token")
	require.Contains(t, refused[2].Result, "Origin/Referer")

	res := alice.post("/letters/discard", discard(csrf), map[string]string{"Origin": "", "Referer": b.ts.URL + "/letters/1"})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Zero(t, b.count(t, "txbox_dlq", "true"))
	require.Contains(t, alice.get("/letters").body, "Done: discarded 1 letter(s).")
	audit := b.audit(t)
	require.Equal(t, auditRow{Operator: "alice", Action: "discard", Target: `letters: id="` + strconv.FormatInt(id, 10) + `"`,
		Detail: "1 letter(s) seen", Result: "discarded 1 letter(s)"}, audit[len(audit)-1])

	// A script sends the token in a header instead.
	id2 := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: "m-2", Reason: "boom"})
	res = alice.post("/letters/discard", url.Values{"id": {strconv.FormatInt(id2, 10)}, "expect": {"1"}}, map[string]string{"X-CSRF-Token": csrf})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Zero(t, b.count(t, "txbox_dlq", "true"))
}
