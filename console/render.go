package console

import (
	"bytes"
	"embed"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"html/template"
	"io/fs"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"time"
	"unicode/utf8"

	"github.com/txbox/txbox/internal/age"
	"github.com/txbox/txbox/internal/visible"
)

//go:embed web
var web embed.FS

// csp allows scripts, styles and requests from the console itself only: no inline script, no
// inline style, nothing from elsewhere, no framing, forms posting only back to the console.
const csp = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; " +
	"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// pages holds one template per page, each the layout plus the page's own file.
type pages map[string]*template.Template

// Everything from the database reaches a page through html/template, which escapes it for its
// context, and through these functions, which make what escaping leaves visible (terminal escapes,
// bidi overrides) harmless. None returns a trusted type (template.HTML and friends): no stored
// text is ever markup.
var funcs = template.FuncMap{
	"line":    func(s string) string { return visible.Escape(s, false) },
	"lines":   func(s string) string { return visible.Escape(s, true) },
	"age":     age.Format,
	"since":   func(t time.Time) string { return age.Format(time.Since(t)) },
	"time":    showTime,
	"payload": showPayload,
	"keys":    func(m map[string]string) []string { return slices.Sorted(maps.Keys(m)) },
	"link":    link,
}

func parsePages() (pages, error) {
	base, err := template.New("layout.html").Funcs(funcs).ParseFS(web, "web/templates/layout.html", "web/templates/partials.html")
	if err != nil {
		return nil, err
	}
	names, err := fs.Glob(web, "web/templates/*.html")
	if err != nil {
		return nil, err
	}
	p := pages{}
	for _, name := range names {
		short := name[len("web/templates/"):]
		if short == "layout.html" || short == "partials.html" {
			continue
		}
		t, err := template.Must(base.Clone()).ParseFS(web, name)
		if err != nil {
			return nil, err
		}
		p[short] = t
	}
	return p, nil
}

// view is what every page gets: the layout's needs and the page's Data.
type view struct {
	Title     string
	Path      string
	CanChange bool // the console accepts changes at all
	Operator  string
	CSRF      string
	Flash     string
	RefreshMs int64
	Data      any
}

// render writes a page. sess is the request's session when the handler already has it (nil: look
// it up). The page is rendered into a buffer first, so a template error is a clean 500.
func (s *Server) render(w http.ResponseWriter, r *http.Request, status int, name, title string, data any, sess *session) {
	if sess == nil {
		if got, ok := s.sessions.get(r); ok {
			sess = &got
		}
	}
	v := view{Title: title, Path: r.URL.Path, CanChange: s.CanChange(), RefreshMs: s.cfg.Refresh.Milliseconds(), Data: data}
	if sess != nil {
		v.Operator, v.CSRF = sess.operator, sess.csrf
		v.Flash = s.sessions.takeFlash(sess.id)
	}
	var buf bytes.Buffer
	if err := s.pages[name].ExecuteTemplate(&buf, "layout.html", v); err != nil {
		s.log.Error("console: render", "page", name, "error", err)
		http.Error(w, "the page could not be rendered", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// fail renders an error page saying msg.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, status int, msg string) {
	s.render(w, r, status, "error.html", http.StatusText(status), msg, nil)
}

// writeJSON answers a script's request.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// guard sets the security headers of every response and refuses requests for host names that are
// not the console's (DNS rebinding).
func (s *Server) guard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", csp)
		h.Set("X-Frame-Options", "DENY")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Cache-Control", "no-store")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		h.Set("Cross-Origin-Resource-Policy", "same-origin")
		if !s.hostAllowed(r.Host) {
			http.Error(w, "this console does not answer to that host name (see --allowed-hosts)", http.StatusMisdirectedRequest)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func showTime(t time.Time) string {
	if t.IsZero() {
		return "—"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// maxShownPayload is the most of a payload a page shows.
const maxShownPayload = 256 << 10

// payloadView is a payload as a page shows it: always as text.
type payloadView struct {
	Bytes     int
	Format    string // "JSON", "text" or "base64"
	Text      string
	Truncated bool
}

// showPayload renders a payload ([]byte or string) as text: JSON indented, other UTF-8 as it is,
// anything else in base64; escaped by visible.Escape either way.
func showPayload(payload any) (payloadView, error) {
	var p []byte
	switch x := payload.(type) {
	case []byte:
		p = x
	case string:
		p = []byte(x)
	default:
		return payloadView{}, fmt.Errorf("payload: %T is not a payload", payload)
	}
	v := payloadView{Bytes: len(p)}
	var text string
	var indented bytes.Buffer
	switch {
	case len(p) > 0 && json.Valid(p) && json.Indent(&indented, p, "", "  ") == nil:
		v.Format, text = "JSON", indented.String()
	case utf8.Valid(p):
		v.Format, text = "text", string(p)
	default:
		v.Format, text = "base64", base64.StdEncoding.EncodeToString(p)
	}
	if len(text) > maxShownPayload {
		cut := maxShownPayload
		for cut > 0 && !utf8.RuneStart(text[cut]) {
			cut--
		}
		text, v.Truncated = text[:cut], true
	}
	v.Text = visible.Escape(text, true)
	return v, nil
}

// link builds a link to a page of the console from its path and pairs of names and values, leaving
// out empty values: {{link "/letters" "consumer" .Consumer}}. Pages insert it as a whole URL, which
// html/template checks and escapes as one.
func link(path string, pairs ...any) (string, error) {
	if len(pairs)%2 != 0 {
		return "", fmt.Errorf("link: odd number of arguments")
	}
	q := url.Values{}
	for i := 0; i < len(pairs); i += 2 {
		name, ok := pairs[i].(string)
		if !ok {
			return "", fmt.Errorf("link: name %v is not a string", pairs[i])
		}
		if value := fmt.Sprint(pairs[i+1]); value != "" {
			q.Set(name, value)
		}
	}
	if len(q) == 0 {
		return path, nil
	}
	return path + "?" + q.Encode(), nil
}
