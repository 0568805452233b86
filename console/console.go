package console

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/sqlname"
	"github.com/txbox/txbox/relay"
)

// Defaults of Config.
const (
	DefaultSessionTTL = 8 * time.Hour
	DefaultRefresh    = 2 * time.Second
	// MinTokenLength is the shortest operator token New accepts: the token is all that stands
	// between whoever reaches the console and the power to discard dead letters.
	MinTokenLength = 16
)

// DB is what the console needs from PostgreSQL; *pgxpool.Pool satisfies it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Config configures a Server. Zero values mean the documented defaults.
type Config struct {
	// DB is the database txbox lives in. Required.
	DB DB
	// Schema holds txbox's tables. If not specified, defaults to "public".
	Schema string
	// Token is the operator token: whoever signs in with it may redrive, discard and bury. If not
	// specified, the console is read-only. Otherwise it must be at least MinTokenLength bytes. It
	// is compared in constant time and never logged, echoed or stored.
	Token string
	// ReadOnly refuses every change even when Token is set.
	ReadOnly bool
	// AllowedHosts are the host names, besides localhost and IP addresses, that a request's Host
	// header may name: the names operators reach the console by, behind a proxy say. Any other
	// name is refused, so that a web page cannot rebind its own name to the console's address
	// (DNS rebinding) and read it.
	AllowedHosts []string
	// SessionTTL is how long a sign-in lasts. If not specified, defaults to DefaultSessionTTL.
	SessionTTL time.Duration
	// Refresh is how often the overview polls for a new snapshot. If not specified, defaults to
	// DefaultRefresh.
	Refresh time.Duration
	// Window is how far back the overview's dedup hit rate and call failures look. If not
	// specified, defaults to status.DefaultWindow.
	Window time.Duration
	// Logger receives one line per change an operator makes and per refused sign-in. If not
	// specified, nothing is logged.
	Logger *slog.Logger
}

// Server is the console: an http.Handler serving its pages, plus the redrives it runs in the
// background. Close stops those. It is safe for concurrent use.
type Server struct {
	cfg      Config
	letters  *dlq.Admin
	outbox   *relay.Admin
	sql      queries
	pages    pages
	sessions *sessions
	signIns  *rate.Limiter
	handler  http.Handler
	redrives *redrives
	log      *slog.Logger
}

// New validates cfg and returns a Server.
func New(cfg Config) (*Server, error) {
	if cfg.DB == nil {
		return nil, errors.New("console: Config.DB is required")
	}
	quoted, err := sqlname.Schema(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("console: Config.Schema: %w", err)
	}
	if cfg.Token != "" && len(cfg.Token) < MinTokenLength {
		return nil, ErrTokenTooShort
	}
	for _, h := range cfg.AllowedHosts {
		if h == "" || strings.ContainsAny(h, ":/ ") {
			return nil, fmt.Errorf("console: Config.AllowedHosts must hold host names without ports, got %q", h)
		}
	}
	switch {
	case cfg.SessionTTL == 0:
		cfg.SessionTTL = DefaultSessionTTL
	case cfg.SessionTTL < time.Minute:
		return nil, fmt.Errorf("console: Config.SessionTTL must be at least 1m, got %s", cfg.SessionTTL)
	}
	switch {
	case cfg.Refresh == 0:
		cfg.Refresh = DefaultRefresh
	case cfg.Refresh < 100*time.Millisecond:
		return nil, fmt.Errorf("console: Config.Refresh must be at least 100ms, got %s", cfg.Refresh)
	}
	if cfg.Window < 0 {
		return nil, fmt.Errorf("console: Config.Window must not be negative, got %s", cfg.Window)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	letters, err := dlq.NewAdmin(dlq.AdminConfig{Schema: cfg.Schema})
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	outbox, err := relay.NewAdmin(relay.AdminConfig{Schema: cfg.Schema})
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	pages, err := parsePages()
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	key := make([]byte, 32)
	_, _ = rand.Read(key) // crypto/rand.Read never fails
	s := &Server{
		cfg: cfg, letters: letters, outbox: outbox, sql: renderQueries(quoted), pages: pages,
		sessions: newSessions(key, cfg.SessionTTL), signIns: newSignInLimit(), log: cfg.Logger,
	}
	s.redrives = newRedrives()
	s.handler = s.routes()
	return s, nil
}

// ServeHTTP serves the console.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// CanChange reports whether an operator may sign in and change anything: a Token is set and the
// console is not ReadOnly.
func (s *Server) CanChange() bool { return s.cfg.Token != "" && !s.cfg.ReadOnly }

// Check verifies that the schema has what the console needs: a console that can change anything
// must be able to audit the change (migration 00007).
func (s *Server) Check(ctx context.Context) error {
	if !s.CanChange() {
		return nil
	}
	var ok bool
	if err := s.cfg.DB.QueryRow(ctx, s.sql.auditExists).Scan(&ok); err != nil {
		return fmt.Errorf("console: look for the audit table: %w", err)
	}
	if !ok {
		return ErrNotMigrated
	}
	return nil
}

// ErrTokenTooShort is returned by New for a Config.Token shorter than MinTokenLength. Neither it
// nor any other message says what the token is.
var ErrTokenTooShort = fmt.Errorf("console: Config.Token must be at least %d bytes long", MinTokenLength)

// ErrNotMigrated is returned by Check when the audit table is missing.
var ErrNotMigrated = errors.New("console: the schema has no audit table (txbox_console_audit): run txbox migrate up, or serve the console read-only")

// Close cancels the redrives running in the background and waits for them to stop: each stops
// between two batches or rolls its current batch back, and its end is audited. Run it after the
// HTTP server stopped taking requests.
func (s *Server) Close() { s.redrives.close() }

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	static, _ := fs.Sub(web, "web/static") // the directory is embedded: Sub cannot fail
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /{$}", s.overviewPage)
	mux.HandleFunc("GET /api/status", s.statusJSON)
	mux.HandleFunc("GET /letters", s.lettersPage)
	mux.HandleFunc("GET /letters/{id}", s.letterPage)
	mux.HandleFunc("POST /letters/discard", s.mutating(s.discard))
	mux.HandleFunc("GET /letters/redrive", s.redrivePlanPage)
	mux.HandleFunc("POST /letters/redrive", s.mutating(s.startRedrive))
	mux.HandleFunc("GET /redrives", s.redrivesPage)
	mux.HandleFunc("GET /redrives/{id}", s.redrivePage)
	mux.HandleFunc("GET /api/redrives/{id}", s.redriveJSON)
	mux.HandleFunc("POST /redrives/{id}/stop", s.mutating(s.cancelRedrive))
	mux.HandleFunc("GET /outbox", s.outboxPage)
	mux.HandleFunc("GET /outbox/{id}", s.outboxRowPage)
	mux.HandleFunc("POST /outbox/{id}/bury", s.mutating(s.bury))
	mux.HandleFunc("GET /calls", s.callsPage)
	mux.HandleFunc("GET /audit", s.auditPage)
	mux.HandleFunc("GET /login", s.signInPage)
	mux.HandleFunc("POST /login", s.signIn)
	mux.HandleFunc("POST /logout", s.mutating(s.signOut))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.fail(w, r, http.StatusNotFound, "There is no such page.")
	})
	return s.guard(mux)
}
