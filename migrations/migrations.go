// Package migrations holds txbox's database schema as goose SQL migrations and applies them to the
// PostgreSQL schema of your choice.
//
//	db, err := sql.Open("pgx", dsn) // import _ "github.com/jackc/pgx/v5/stdlib"; or stdlib.OpenDBFromPool(pool)
//	...
//	_, err = migrations.Up(ctx, db, migrations.WithSchema("txbox"))
//
// Give the same schema to the outbox, inbox, relay, dlq and retention configs. The command line
// does the same: `txbox migrate up --schema txbox`.
//
// # Locking and the schema
//
// Every operation that changes or reads the migration state takes a PostgreSQL advisory lock for
// the database and schema on one session, so processes migrating the same schema at once take
// turns. Under that lock Up creates the schema when it is missing (so concurrent first installs do
// not collide), and the session's search_path is set to the schema for goose, whose SQL files name
// tables unqualified; the search_path is reset before the connection goes back to db's pool. Status
// and Down never create anything: on a missing schema they return ErrSchemaNotFound, and Down
// refuses while txbox's tables hold messages (a *NotEmptyError) unless WithForce is given.
//
// # goose
//
// NewProvider returns the goose Provider itself, with txbox's version table and the lock above,
// for callers who want goose's finer operations (UpByOne, DownTo, ...). It creates the schema
// under the lock when it is missing, because goose's Up first looks for pending migrations without
// the lock (HasPending), which creates goose's version table; goose retries that creation when
// two processes race on it.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"hash/crc64"
	"log/slog"

	"github.com/pressly/goose/v3"

	"github.com/txbox/txbox/internal/sqlname"
)

// FS holds the goose SQL files of this directory: the only definition of txbox's schema.
//
//go:embed *.sql
var FS embed.FS

// VersionTable is the name of goose's version table for txbox, distinct from goose's default so it
// cannot clash with an application's own goose migrations in the same schema.
const VersionTable = "txbox_goose_db_version"

var (
	// ErrSchemaNotFound is returned by Status and Down when the schema does not exist.
	ErrSchemaNotFound = errors.New("migrations: schema does not exist")
	// ErrNotInstalled is returned by Down when the schema exists but txbox was never migrated into
	// it (it has no VersionTable).
	ErrNotInstalled = errors.New("migrations: txbox is not installed in the schema")
)

// NotEmptyError is returned by Down, without WithForce, while txbox's tables hold messages that
// dropping them would lose.
type NotEmptyError struct {
	Schema string
	// OutboxRows are messages and side-effect calls not yet published or executed.
	OutboxRows int64
	// DeadLetters are letters not yet redriven or discarded.
	DeadLetters int64
}

func (e *NotEmptyError) Error() string {
	return fmt.Sprintf("migrations: schema %s holds %d pending outbox row(s) and %d dead letter(s); rolling back would drop them",
		e.Schema, e.OutboxRows, e.DeadLetters)
}

// Option configures NewProvider, Up, Down and Status.
type Option func(*options)

type options struct {
	schema string
	force  bool
	goose  []goose.ProviderOption
}

// WithSchema names the schema txbox's tables live in. If not given, defaults to "public". It must
// be a lower-case identifier and not a system schema (pg_*, information_schema).
func WithSchema(name string) Option { return func(o *options) { o.schema = name } }

// WithForce lets Down drop txbox's tables while they still hold outbox rows or dead letters.
func WithForce() Option { return func(o *options) { o.force = true } }

// WithGooseOptions appends goose provider options (goose.WithSlog for goose's log lines, say).
// Options that replace txbox's version table or session locker break the guarantees above.
func WithGooseOptions(opts ...goose.ProviderOption) Option {
	return func(o *options) { o.goose = append(o.goose, opts...) }
}

// mode is what the session locker checks and does once it holds the lock.
type mode int

const (
	createSchema    mode = iota // create the schema when it is missing
	mustBeInstalled             // the schema must exist and hold VersionTable
	mustBeEmpty                 // ... and txbox's tables must hold no outbox rows or dead letters
)

// NewProvider returns a goose provider for txbox's migrations in the schema given by WithSchema,
// with txbox's version table and the advisory lock described in the package documentation. It
// creates the schema, under the lock, when it is missing.
func NewProvider(ctx context.Context, db *sql.DB, opts ...Option) (*goose.Provider, error) {
	return newProvider(ctx, db, createSchema, opts)
}

// Up creates the schema when it is missing and applies every pending migration, returning what
// it applied. A migration that fails is returned as a *goose.PartialError.
func Up(ctx context.Context, db *sql.DB, opts ...Option) ([]*goose.MigrationResult, error) {
	p, err := newProvider(ctx, db, createSchema, opts)
	if err != nil {
		return nil, err
	}
	res, err := p.Up(ctx)
	if err != nil {
		return res, fmt.Errorf("migrations: up: %w", err)
	}
	return res, nil
}

// Down rolls back every applied migration, removing txbox's tables and everything in them. It
// returns ErrSchemaNotFound or ErrNotInstalled when there is nothing to roll back, and a
// *NotEmptyError while outbox rows or dead letters exist, unless WithForce is given.
func Down(ctx context.Context, db *sql.DB, opts ...Option) ([]*goose.MigrationResult, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	m := mustBeEmpty
	if o.force {
		m = mustBeInstalled
	}
	p, err := newProvider(ctx, db, m, opts)
	if err != nil {
		return nil, err
	}
	res, err := p.DownTo(ctx, 0)
	if err != nil {
		return res, fmt.Errorf("migrations: down: %w", err)
	}
	return res, nil
}

// Status lists every migration and whether it is applied. On a schema that exists but where txbox
// was never installed, every migration is pending; a missing schema is ErrSchemaNotFound. It
// creates nothing.
func Status(ctx context.Context, db *sql.DB, opts ...Option) ([]*goose.MigrationStatus, error) {
	p, err := newProvider(ctx, db, mustBeInstalled, opts)
	if err != nil {
		return nil, err
	}
	st, err := p.Status(ctx)
	if errors.Is(err, ErrNotInstalled) {
		st = nil
		for _, s := range p.ListSources() {
			st = append(st, &goose.MigrationStatus{Source: s, State: goose.StatePending})
		}
		return st, nil
	}
	if err != nil {
		return nil, fmt.Errorf("migrations: status: %w", err)
	}
	return st, nil
}

func newProvider(ctx context.Context, db *sql.DB, m mode, opts []Option) (*goose.Provider, error) {
	o := options{schema: sqlname.DefaultSchema}
	for _, opt := range opts {
		opt(&o)
	}
	if o.schema == "" {
		o.schema = sqlname.DefaultSchema // As everywhere else: WithSchema("") is the default.
	}
	quoted, err := sqlname.Schema(o.schema)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	var database string
	if err := db.QueryRowContext(ctx, currentDatabaseSQL).Scan(&database); err != nil {
		return nil, fmt.Errorf("migrations: find the database: %w", err)
	}
	// One lock per database and schema: installs in different schemas do not wait for each other.
	// The key is the one earlier versions derived from current_schema(), so old and new binaries
	// migrating one schema still take turns.
	lockID := int64(crc64.Checksum([]byte("txbox-migrations:"+database+"."+o.schema), crc64.MakeTable(crc64.ECMA)) >> 1)
	locker := &sessionLocker{lockID: lockID, schema: o.schema, sql: renderQueries(quoted), mode: m}
	base := []goose.ProviderOption{
		// Qualified, so that HasPending and GetVersions, which take no lock and so run without the
		// search_path, read the right table.
		goose.WithTableName(o.schema + "." + VersionTable),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
		goose.WithSlog(slog.New(slog.DiscardHandler)),
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, FS, append(base, o.goose...)...)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	if m == createSchema {
		// goose's Up looks for pending migrations before it takes the lock, and that look creates
		// its version table: the schema must exist by then.
		if err := ensureSchema(ctx, db, locker); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// ensureSchema creates the schema if it is missing, under the lock.
func ensureSchema(ctx context.Context, db *sql.DB, l *sessionLocker) error {
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	defer conn.Close()
	if err := l.SessionLock(ctx, conn); err != nil {
		return err
	}
	return l.SessionUnlock(ctx, conn)
}

// sessionLocker is goose's SessionLocker for txbox: an advisory lock per database and schema, then
// the checks of its mode and the search_path, all on the session goose migrates with.
type sessionLocker struct {
	lockID int64
	schema string
	sql    queries
	mode   mode
}

func (l *sessionLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	if _, err := conn.ExecContext(ctx, lockSQL, l.lockID); err != nil {
		return fmt.Errorf("migrations: lock schema %s: %w", l.schema, err)
	}
	if err := l.prepare(ctx, conn); err != nil {
		// goose does not unlock a session whose SessionLock failed.
		return errors.Join(err, l.SessionUnlock(context.WithoutCancel(ctx), conn))
	}
	return nil
}

func (l *sessionLocker) prepare(ctx context.Context, conn *sql.Conn) error {
	var exists bool
	if err := conn.QueryRowContext(ctx, schemaExistsSQL, l.schema).Scan(&exists); err != nil {
		return fmt.Errorf("migrations: look for schema %s: %w", l.schema, err)
	}
	switch {
	case !exists && l.mode == createSchema:
		if _, err := conn.ExecContext(ctx, l.sql.createSchema); err != nil {
			return fmt.Errorf("migrations: create schema %s: %w", l.schema, err)
		}
	case !exists:
		return fmt.Errorf("%w: %s", ErrSchemaNotFound, l.schema)
	case l.mode == mustBeInstalled || l.mode == mustBeEmpty:
		var installed bool
		if err := conn.QueryRowContext(ctx, l.sql.installed).Scan(&installed); err != nil {
			return fmt.Errorf("migrations: look for %s.%s: %w", l.schema, VersionTable, err)
		}
		if !installed {
			return fmt.Errorf("%w: %s has no %s table", ErrNotInstalled, l.schema, VersionTable)
		}
		if l.mode == mustBeEmpty {
			if err := l.checkEmpty(ctx, conn); err != nil {
				return err
			}
		}
	}
	if _, err := conn.ExecContext(ctx, l.sql.setSearchPath); err != nil {
		return fmt.Errorf("migrations: set search_path to %s: %w", l.schema, err)
	}
	return nil
}

func (l *sessionLocker) checkEmpty(ctx context.Context, conn *sql.Conn) error {
	var tables bool
	if err := conn.QueryRowContext(ctx, l.sql.tablesExist).Scan(&tables); err != nil {
		return fmt.Errorf("migrations: look for txbox's tables: %w", err)
	}
	if !tables {
		return nil
	}
	e := NotEmptyError{Schema: l.schema}
	if err := conn.QueryRowContext(ctx, l.sql.rowsLeft).Scan(&e.OutboxRows, &e.DeadLetters); err != nil {
		return fmt.Errorf("migrations: count rows left: %w", err)
	}
	if e.OutboxRows > 0 || e.DeadLetters > 0 {
		return &e
	}
	return nil
}

func (l *sessionLocker) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	_, resetErr := conn.ExecContext(ctx, resetSearchPathSQL)
	var unlocked bool
	err := conn.QueryRowContext(ctx, unlockSQL, l.lockID).Scan(&unlocked)
	if err == nil && !unlocked {
		err = errors.New("the session did not hold the lock")
	}
	if err != nil {
		err = fmt.Errorf("migrations: unlock schema %s: %w", l.schema, err)
	}
	return errors.Join(resetErr, err)
}
