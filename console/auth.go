package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"golang.org/x/time/rate"

	"github.com/txbox/txbox/internal/visible"
)

// cookieName is the session cookie. Its value is a random session id and an HMAC of it under a
// key made when the process started: a cookie is valid only for sessions this process created.
const cookieName = "txbox_console"

// Anonymous sessions exist only to carry the sign-in form's CSRF token; they are short-lived and
// bounded in number, so that requests without cookies cannot fill memory.
const (
	anonymousTTL  = 15 * time.Minute
	maxAnonymous  = 1000
	maxOperator   = 64
	maxFormBytes  = 64 << 10
	csrfFormField = "csrf"
	csrfHeader    = "X-CSRF-Token"
)

// session is one browser's state. Only its id travels in the cookie; the rest stays here.
type session struct {
	id       string
	csrf     string
	operator string // "" until the operator signed in
	expires  time.Time
	flash    string
}

type sessions struct {
	key []byte
	ttl time.Duration

	mu   sync.Mutex
	byID map[string]*session
}

func newSessions(key []byte, ttl time.Duration) *sessions {
	return &sessions{key: key, ttl: ttl, byID: map[string]*session{}}
}

func randomToken() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return base64.RawURLEncoding.EncodeToString(b)
}

func (ss *sessions) sign(id string) string {
	m := hmac.New(sha256.New, ss.key)
	m.Write([]byte(id))
	return id + "." + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// get returns a copy of the request's live session, or false.
func (ss *sessions) get(r *http.Request) (session, bool) {
	c, err := r.Cookie(cookieName)
	if err != nil {
		return session{}, false
	}
	id, _, ok := strings.Cut(c.Value, ".")
	if !ok || !hmac.Equal([]byte(ss.sign(id)), []byte(c.Value)) {
		return session{}, false
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	s, ok := ss.byID[id]
	if !ok {
		return session{}, false
	}
	if time.Now().After(s.expires) {
		delete(ss.byID, id)
		return session{}, false
	}
	return *s, true
}

// start creates a session (anonymous when operator is "") and sets its cookie. Signing in always
// starts a new session, so an id someone saw before sign-in is worth nothing after it.
func (ss *sessions) start(w http.ResponseWriter, r *http.Request, operator string) session {
	ttl := ss.ttl
	if operator == "" {
		ttl = anonymousTTL
	}
	s := &session{id: randomToken(), csrf: randomToken(), operator: operator, expires: time.Now().Add(ttl)}
	ss.mu.Lock()
	now, anonymous := time.Now(), 0
	for id, old := range ss.byID {
		switch {
		case now.After(old.expires):
			delete(ss.byID, id)
		case old.operator == "":
			anonymous++
		}
	}
	if operator == "" && anonymous >= maxAnonymous {
		for id, old := range ss.byID { // Map order: an arbitrary anonymous session goes.
			if old.operator == "" {
				delete(ss.byID, id)
				break
			}
		}
	}
	ss.byID[s.id] = s
	ss.mu.Unlock()
	http.SetCookie(w, &http.Cookie{
		Name: cookieName, Value: ss.sign(s.id), Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode,
		Secure: r.TLS != nil, Expires: s.expires,
	})
	return *s
}

func (ss *sessions) end(w http.ResponseWriter, r *http.Request, id string) {
	ss.mu.Lock()
	delete(ss.byID, id)
	ss.mu.Unlock()
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: "", Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode,
		Secure: r.TLS != nil, MaxAge: -1})
}

// setFlash leaves a message for the session's next page.
func (ss *sessions) setFlash(id, msg string) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if s, ok := ss.byID[id]; ok {
		s.flash = msg
	}
}

// takeFlash returns and forgets the session's message.
func (ss *sessions) takeFlash(id string) string {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	s, ok := ss.byID[id]
	if !ok {
		return ""
	}
	msg := s.flash
	s.flash = ""
	return msg
}

// tokenMatches compares a token in constant time; hashing first makes the time independent of
// the lengths as well.
func tokenMatches(given, want string) bool {
	g, w := sha256.Sum256([]byte(given)), sha256.Sum256([]byte(want))
	return subtle.ConstantTimeCompare(g[:], w[:]) == 1
}

// hostAllowed reports whether a request's Host names the console: localhost, an IP address, or a
// configured name. A page on some other name that resolves to the console's address (DNS
// rebinding) is refused; an IP address cannot be a rebound name.
func (s *Server) hostAllowed(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		host = hostport
	}
	host = strings.TrimSuffix(strings.ToLower(strings.Trim(host, "[]")), ".")
	if host == "localhost" || net.ParseIP(host) != nil {
		return true
	}
	return slices.ContainsFunc(s.cfg.AllowedHosts, func(h string) bool { return strings.EqualFold(h, host) })
}

// sameOrigin reports whether a request that changes something came from one of the console's own
// pages: its Origin, or when a browser sent none its Referer, names the host the request was sent
// to. The scheme is not compared, so that a TLS-terminating proxy in front works; Host itself
// passed hostAllowed.
func sameOrigin(r *http.Request) bool {
	from := r.Header.Get("Origin")
	if from == "" || from == "null" {
		from = r.Header.Get("Referer")
	}
	if from == "" {
		return false
	}
	u, err := url.Parse(from)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != "" && strings.EqualFold(u.Host, r.Host)
}

// operatorName checks the name an operator signs in with: it goes into the audit as it is.
func operatorName(s string) (string, bool) {
	s = strings.TrimSpace(s)
	if s == "" || len(s) > maxOperator || !utf8.ValidString(s) || visible.Escape(s, false) != s {
		return "", false
	}
	return s, true
}

type ctxKey struct{}

// operatorFrom returns the signed-in operator of a request that passed s.mutating.
func operatorFrom(ctx context.Context) session {
	sess, _ := ctx.Value(ctxKey{}).(session)
	return sess
}

// mutating guards a request that changes something: the console must allow changes, the request
// must come from one of its pages (Origin/Referer), from a signed-in session, with that session's
// CSRF token (a form field, or a header for scripts).
func (s *Server) mutating(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !s.CanChange() {
			s.fail(w, r, http.StatusForbidden, "This console is read-only: nothing can be changed through it.")
			return
		}
		sess, ok := s.sessions.get(r)
		if !sameOrigin(r) {
			s.refuse(w, r, sess.operator, "the request did not come from a page of this console (Origin/Referer)")
			return
		}
		if !ok || sess.operator == "" {
			s.refuse(w, r, "", "no operator is signed in; sign in first")
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if err := r.ParseForm(); err != nil {
			s.fail(w, r, http.StatusBadRequest, "The form could not be read.")
			return
		}
		given := r.Header.Get(csrfHeader)
		if given == "" {
			given = r.PostForm.Get(csrfFormField)
		}
		if subtle.ConstantTimeCompare([]byte(given), []byte(sess.csrf)) != 1 {
			s.refuse(w, r, sess.operator, "the form's CSRF token does not belong to this session; reload the page and try again")
			return
		}
		h(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, sess)))
	}
}

// refuse answers 403 to a change or sign-in that the console's checks refused, and logs it. A
// refusal that names an operator's session (a page of another site posting through their
// browser, say) is audited too; one without is not, so that anyone who can reach the console
// cannot fill the audit table.
func (s *Server) refuse(w http.ResponseWriter, r *http.Request, operator, why string) {
	s.log.Warn("console: request refused", "method", r.Method, "path", r.URL.Path, "operator", operator, "remote", r.RemoteAddr, "why", why)
	if operator != "" {
		_ = s.auditAlone(r.Context(), auditEntry{Operator: operator, Action: r.Method + " " + r.URL.Path, Target: "console", Result: "refused: " + why})
	}
	s.fail(w, r, http.StatusForbidden, "Refused: "+why+".")
}

// signInLimit bounds sign-in attempts, right or wrong, for the whole console: guessing a token
// of MinTokenLength bytes at this pace takes longer than anyone has.
func newSignInLimit() *rate.Limiter { return rate.NewLimiter(rate.Every(time.Second), 5) }

func (s *Server) signInPage(w http.ResponseWriter, r *http.Request) {
	sess, ok := s.sessions.get(r)
	if s.CanChange() && !ok {
		sess = s.sessions.start(w, r, "")
	}
	s.render(w, r, http.StatusOK, "login.html", "Sign in", signInView{Next: safeNext(r.URL.Query().Get("next"))}, &sess)
}

type signInView struct {
	Next, Operator, Error string
}

func (s *Server) signIn(w http.ResponseWriter, r *http.Request) {
	if !s.CanChange() {
		s.fail(w, r, http.StatusForbidden, "This console is read-only: nobody can sign in.")
		return
	}
	if !sameOrigin(r) {
		s.refuse(w, r, "", "the request did not come from a page of this console (Origin/Referer)")
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		s.fail(w, r, http.StatusBadRequest, "The form could not be read.")
		return
	}
	anon, ok := s.sessions.get(r)
	if !ok || subtle.ConstantTimeCompare([]byte(r.PostForm.Get(csrfFormField)), []byte(anon.csrf)) != 1 {
		s.refuse(w, r, "", "the sign-in form expired or did not come from this console; open it again")
		return
	}
	view := signInView{Next: safeNext(r.PostForm.Get("next"))}
	if !s.signIns.Allow() {
		view.Error = "Too many sign-in attempts; wait a few seconds."
		s.render(w, r, http.StatusTooManyRequests, "login.html", "Sign in", view, &anon)
		return
	}
	name, valid := operatorName(r.PostForm.Get("operator"))
	if !valid {
		view.Error = "Give your name (1 to 64 printable characters): the audit records who changed what."
		s.render(w, r, http.StatusBadRequest, "login.html", "Sign in", view, &anon)
		return
	}
	view.Operator = name
	if !tokenMatches(r.PostForm.Get("token"), s.cfg.Token) {
		s.log.Warn("console: sign-in refused: wrong token", "operator", name, "remote", r.RemoteAddr)
		s.auditAlone(r.Context(), auditEntry{Operator: name, Action: "sign in", Target: "console", Result: "refused: wrong token"})
		view.Error = "Wrong token."
		s.render(w, r, http.StatusForbidden, "login.html", "Sign in", view, &anon)
		return
	}
	if err := s.auditAlone(r.Context(), auditEntry{Operator: name, Action: "sign in", Target: "console", Result: "ok"}); err != nil {
		view.Error = "The sign-in could not be audited, so it was refused: " + err.Error()
		s.render(w, r, http.StatusInternalServerError, "login.html", "Sign in", view, &anon)
		return
	}
	s.sessions.end(w, r, anon.id)
	sess := s.sessions.start(w, r, name)
	s.log.Info("console: operator signed in", "operator", name, "remote", r.RemoteAddr)
	s.sessions.setFlash(sess.id, "Signed in as "+name+".")
	http.Redirect(w, r, view.Next, http.StatusSeeOther)
}

func (s *Server) signOut(w http.ResponseWriter, r *http.Request) {
	sess := operatorFrom(r.Context())
	_ = s.auditAlone(r.Context(), auditEntry{Operator: sess.operator, Action: "sign out", Target: "console", Result: "ok"})
	s.sessions.end(w, r, sess.id)
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// safeNext keeps a redirect target on this console: a path, never another host.
func safeNext(next string) string {
	if !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.HasPrefix(next, "/\\") {
		return "/"
	}
	u, err := url.Parse(next)
	if err != nil || u.Host != "" || u.Scheme != "" {
		return "/"
	}
	return u.RequestURI()
}
