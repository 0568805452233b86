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
// the database and schema, so processes migrating the same schema at once take turns. The lock is
// a transaction's (pg_try_advisory_xact_lock, asked again with a backoff of up to a second, so a
// waiting process holds no connection), held open on a second connection of db while goose
// migrates on the first, so db must allow two open connections. Under that lock Up creates the
// schema when it is missing (so concurrent first installs do not collide). goose's SQL files name
// tables unqualified: each migration runs in its own transaction, which opens with SET LOCAL
// search_path to the schema. Nothing is set on a session, so migrating works through a
// transaction pooler (PgBouncer's pool_mode=transaction, whose pool must then give the database
// two server connections) and leaves db's connections as they were. Status and Down never create
// anything: on a missing schema they return ErrSchemaNotFound, and Down refuses while txbox's
// tables hold messages (a *NotEmptyError) unless WithForce is given.
//
// # goose
//
// NewProvider returns the goose Provider itself, with txbox's version table, the lock and the
// search_path above, for callers who want goose's finer operations (UpByOne, DownTo, ...). It
// creates the schema under the lock when it is missing, because goose's Up first looks for
// pending migrations without the lock (HasPending), which creates goose's version table; goose
// retries that creation when two processes race on it.
package migrations

import (
	"bytes"
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"hash/crc64"
	"io"
	"io/fs"
	"log/slog"
	"path"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
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
// Options that replace txbox's version table or locker break the guarantees above.
func WithGooseOptions(opts ...goose.ProviderOption) Option {
	return func(o *options) { o.goose = append(o.goose, opts...) }
}

// mode is what the lock checks and does once it is held.
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
	p, _, err := newProvider(ctx, db, createSchema, opts)
	return p, err
}

// Up creates the schema when it is missing and applies every pending migration, returning what
// it applied. A migration that fails is returned as a *goose.PartialError.
func Up(ctx context.Context, db *sql.DB, opts ...Option) ([]*goose.MigrationResult, error) {
	p, lock, err := newProvider(ctx, db, createSchema, opts)
	if err != nil {
		return nil, err
	}
	res, err := p.Up(ctx)
	if err != nil {
		return res, lock.explainLockWait(ctx, db, fmt.Errorf("migrations: up: %w", err))
	}
	// A Down that was stopped after it fenced writers off (schemaLock.fenceEmpty) left the fence:
	// the schema is migrated up again, so writes are welcome again.
	if err := lock.unfence(ctx, db); err != nil {
		return res, err
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
	p, lock, err := newProvider(ctx, db, m, opts)
	if err != nil {
		return nil, err
	}
	res, err := p.DownTo(ctx, 0)
	if err != nil {
		err = lock.explainLockWait(ctx, db, fmt.Errorf("migrations: down: %w", err))
		if !o.force {
			// Fenced, then failed: writers would go on failing for tables that stay. Removed even
			// when ctx is what stopped Down (an operator's Ctrl-C while a migration waited for a
			// lock, say): the removal waits at most lockWait itself.
			err = errors.Join(err, lock.unfence(context.WithoutCancel(ctx), db))
		}
		return res, err
	}
	return res, nil
}

// Status lists every migration and whether it is applied. On a schema that exists but where txbox
// was never installed, every migration is pending; a missing schema is ErrSchemaNotFound. It
// creates nothing.
func Status(ctx context.Context, db *sql.DB, opts ...Option) ([]*goose.MigrationStatus, error) {
	p, _, err := newProvider(ctx, db, mustBeInstalled, opts)
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

func newProvider(ctx context.Context, db *sql.DB, m mode, opts []Option) (*goose.Provider, *schemaLock, error) {
	if db == nil {
		return nil, nil, errors.New("migrations: db is nil")
	}
	o := options{schema: sqlname.DefaultSchema}
	for _, opt := range opts {
		opt(&o)
	}
	if o.schema == "" {
		o.schema = sqlname.DefaultSchema // As everywhere else: WithSchema("") is the default.
	}
	quoted, err := sqlname.Schema(o.schema)
	if err != nil {
		return nil, nil, fmt.Errorf("migrations: %w", err)
	}
	var database string
	if err := db.QueryRowContext(ctx, currentDatabaseSQL).Scan(&database); err != nil {
		return nil, nil, fmt.Errorf("migrations: find the database: %w", err)
	}
	// One lock per database and schema: installs in different schemas do not wait for each other.
	// The key is the one earlier versions derived from current_schema(), so old and new binaries
	// migrating one schema still take turns.
	lockID := int64(crc64.Checksum([]byte("txbox-migrations:"+database+"."+o.schema), crc64.MakeTable(crc64.ECMA)) >> 1)
	if db.Stats().MaxOpenConnections == 1 {
		return nil, nil, errors.New("migrations: db allows one open connection (SetMaxOpenConns(1)); migrating needs two: one holds the schema's lock in a transaction while goose migrates on the other")
	}
	q := renderQueries(quoted)
	locker := &schemaLock{lockID: lockID, schema: o.schema, sql: q, mode: m}
	base := []goose.ProviderOption{
		// Qualified, so that HasPending and GetVersions, which take no lock, and goose's inserts
		// into it, read and write the right table whatever the connection's search_path.
		goose.WithTableName(o.schema + "." + VersionTable),
		goose.WithLocker(locker),
		goose.WithDisableGlobalRegistry(true),
		// Branches merged in another order than their migrations were numbered: 00008 landed
		// after 00009, so a schema migrated by a version of that time holds 00009 without 00008.
		// goose refuses such a schema by default ("missing (out-of-order) migration"), and every
		// txbox command then asks for a migrate up that cannot succeed. The migrations do not
		// depend on each other's order below the schema's version, so the missing ones are applied.
		goose.WithAllowOutofOrder(true),
		goose.WithSlog(slog.New(slog.DiscardHandler)),
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, inSchema{FS: FS, preamble: []byte(q.preamble)}, append(base, o.goose...)...)
	if err != nil {
		return nil, nil, fmt.Errorf("migrations: %w", err)
	}
	if m == createSchema {
		// goose's Up looks for pending migrations before it takes the lock, and that look creates
		// its version table: the schema must exist by then.
		if err := ensureSchema(ctx, db, locker); err != nil {
			return nil, nil, err
		}
	}
	return p, locker, nil
}

// ensureSchema creates the schema if it is missing, under the lock.
func ensureSchema(ctx context.Context, db *sql.DB, l *schemaLock) error {
	if err := l.Lock(ctx, db); err != nil {
		return err
	}
	return l.Unlock(ctx, db)
}

// schemaLock is goose's Locker for txbox: a transaction-level advisory lock per database and
// schema, held by a transaction of its own on a second connection while goose migrates on the
// first, and the checks of its mode in that transaction. It leaves nothing on any session, so that
// it works through a transaction pooler, which may run each of goose's transactions on another
// server connection: with a session-level lock and search_path, the lock would stay on whichever
// server connection took it and later migrations could run with the pooler's default search_path.
type schemaLock struct {
	lockID int64
	schema string
	sql    queries
	mode   mode
	held   *sql.Tx // goose's Provider calls Lock and Unlock in turn, never concurrently
}

// A waiting migrator asks again after at most this long. It does not wait inside a transaction:
// through a pooler, a transaction that waits holds a server connection the migrating process may
// need for its next migration.
const maxLockBackoff = time.Second

func (l *schemaLock) Lock(ctx context.Context, db *sql.DB) error {
	backoff := 10 * time.Millisecond
	for {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return fmt.Errorf("migrations: lock schema %s: %w", l.schema, err)
		}
		retry, err := l.lockIn(ctx, tx)
		switch {
		case err != nil:
			return errors.Join(err, tx.Rollback())
		case !retry && l.mode == mustBeEmpty:
			if err := l.fenceEmpty(ctx, db); err != nil {
				return errors.Join(err, tx.Rollback())
			}
			fallthrough
		case !retry:
			l.held = tx
			return nil
		}
		// Not held yet, or held to create the schema, which goose's connection sees only once
		// committed.
		if err := tx.Commit(); err != nil {
			return fmt.Errorf("migrations: lock schema %s: %w", l.schema, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("migrations: lock schema %s: %w", l.schema, context.Cause(ctx))
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, maxLockBackoff)
	}
}

// lockIn tries to take the lock in tx and runs the checks of l's mode under it. retry is true
// when tx should commit and the lock be asked for again: it is held elsewhere, or tx created the
// schema.
func (l *schemaLock) lockIn(ctx context.Context, tx *sql.Tx) (retry bool, err error) {
	var locked bool
	if err := tx.QueryRowContext(ctx, lockSQL, l.lockID).Scan(&locked); err != nil {
		return false, fmt.Errorf("migrations: lock schema %s: %w", l.schema, err)
	}
	if !locked {
		return true, nil
	}
	var exists bool
	if err := tx.QueryRowContext(ctx, schemaExistsSQL, l.schema).Scan(&exists); err != nil {
		return false, fmt.Errorf("migrations: look for schema %s: %w", l.schema, err)
	}
	switch {
	case !exists && l.mode == createSchema:
		if _, err := tx.ExecContext(ctx, l.sql.createSchema); err != nil {
			return false, fmt.Errorf("migrations: create schema %s: %w", l.schema, err)
		}
		return true, nil
	case !exists:
		return false, fmt.Errorf("%w: %s", ErrSchemaNotFound, l.schema)
	case l.mode == mustBeInstalled || l.mode == mustBeEmpty:
		var installed bool
		if err := tx.QueryRowContext(ctx, l.sql.installed).Scan(&installed); err != nil {
			return false, fmt.Errorf("migrations: look for %s.%s: %w", l.schema, VersionTable, err)
		}
		if !installed {
			return false, fmt.Errorf("%w: %s has no %s table", ErrNotInstalled, l.schema, VersionTable)
		}
	}
	return false, nil
}

// fenceEmpty makes sure that Down drops no row anyone committed. It counts the outbox rows and
// dead letters in a transaction of its own on db that first puts downFence on both tables, a
// constraint no new row passes. Adding it waits for every transaction that wrote to them to end
// and holds new writes until it commits, so the count sees every row ever committed to them. With
// rows left the transaction rolls back, and no writer ever met the fence. Without, it commits: from
// then on a writer's transaction fails, naming the constraint, where it would have committed a row
// that Down then dropped with its table (a check without the fence, an instant before the drop,
// let rows committed in between be dropped). Up removes a fence a stopped Down left.
func (l *schemaLock) fenceEmpty(ctx context.Context, db *sql.DB) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("migrations: count rows left: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	var tables, fenced bool
	if err := tx.QueryRowContext(ctx, l.sql.tablesExist).Scan(&tables); err != nil {
		return fmt.Errorf("migrations: look for txbox's tables: %w", err)
	}
	if !tables {
		return nil
	}
	if err := tx.QueryRowContext(ctx, l.sql.fenced).Scan(&fenced); err != nil {
		return fmt.Errorf("migrations: look for a fence: %w", err)
	}
	left := func() error {
		e, err := l.rowsLeft(ctx, tx)
		switch {
		case err != nil:
			return err
		case e != nil && fenced:
			// Left by a Down that was stopped; this one is refused, so writes are welcome again.
			return errors.Join(e, l.unfenceIn(ctx, tx), tx.Commit())
		case e != nil:
			return e
		}
		return nil
	}
	// Counted once before the fence too: the fence's lock (ACCESS EXCLUSIVE) holds the relay's
	// reads as well as writes, for as long as the count under it takes, so that count should find
	// nothing, or next to nothing, to count.
	if err := left(); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, fenceLockTimeoutSQL); err != nil {
		return fmt.Errorf("migrations: hold writes off: %w", err)
	}
	if !fenced {
		for _, stmt := range l.sql.fence {
			if _, err := tx.ExecContext(ctx, stmt); err != nil {
				return fmt.Errorf("migrations: hold writes off %s's outbox and dead letters (a transaction that wrote to them did not end?): %w", l.schema, err)
			}
		}
	}
	if err := left(); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("migrations: hold writes off: %w", err)
	}
	return nil
}

// explainLockWait adds to err, when a statement gave up waiting for a lock (lock_timeout, lockWait),
// which sessions hold locks on the schema's tables, so that the operator can find what to end or
// wait for: a session idle in a transaction, typically. Their queries are left out: they may
// carry the application's data.
func (l *schemaLock) explainLockWait(ctx context.Context, db *sql.DB, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" { // lock_not_available
		return err
	}
	rows, qerr := db.QueryContext(ctx, l.sql.lockHolders)
	if qerr != nil {
		return err
	}
	defer rows.Close()
	var holders []string
	for rows.Next() {
		var (
			pid         int64
			state, app  string
			xactSeconds int64
		)
		if rows.Scan(&pid, &state, &app, &xactSeconds) != nil {
			return err
		}
		holders = append(holders, fmt.Sprintf("pid %d (%s, application %q, in its transaction for %ds)", pid, state, app, xactSeconds))
	}
	if len(holders) == 0 {
		return fmt.Errorf("%w; a statement waited %s for a lock on a table of %s, and no session holds one now: run it again", err, lockWait, l.schema)
	}
	return fmt.Errorf("%w; a statement waited %s for a lock on a table of %s, which these sessions hold: %s; end them or let them finish, then run it again",
		err, lockWait, l.schema, strings.Join(holders, ", "))
}

// rowsLeft counts the rows Down would drop: nil when there are none.
func (l *schemaLock) rowsLeft(ctx context.Context, tx *sql.Tx) (*NotEmptyError, error) {
	e := NotEmptyError{Schema: l.schema}
	if err := tx.QueryRowContext(ctx, l.sql.rowsLeft).Scan(&e.OutboxRows, &e.DeadLetters); err != nil {
		return nil, fmt.Errorf("migrations: count rows left: %w", err)
	}
	if e.OutboxRows > 0 || e.DeadLetters > 0 {
		return &e, nil
	}
	return nil, nil
}

// unfence removes the fence of fenceEmpty, if there is one. An error says that the fence stays.
func (l *schemaLock) unfence(ctx context.Context, db *sql.DB) error {
	if err := l.unfenceOnce(ctx, db); err != nil {
		return fmt.Errorf("%w; writes to %s's outbox and dead letters fail on %s until it is removed: migrate up removes it", err, l.schema, downFence)
	}
	return nil
}

func (l *schemaLock) unfenceOnce(ctx context.Context, db *sql.DB) error {
	var fenced bool
	if err := db.QueryRowContext(ctx, l.sql.fenced).Scan(&fenced); err != nil {
		return fmt.Errorf("migrations: look for a fence: %w", err)
	}
	if !fenced {
		return nil
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("migrations: remove the fence: %w", err)
	}
	if err := l.unfenceIn(ctx, tx); err != nil {
		return errors.Join(l.explainLockWait(ctx, db, err), tx.Rollback())
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("migrations: remove the fence: %w", err)
	}
	return nil
}

// unfenceIn drops the fence in tx, waiting at most lockWait for the tables' locks: a session that
// locked them after the fence went up (one idle in a transaction that read the outbox, say) would
// otherwise hold the removal, and every write and read of the outbox queued behind it, as long as
// it lives.
func (l *schemaLock) unfenceIn(ctx context.Context, tx *sql.Tx) error {
	if _, err := tx.ExecContext(ctx, fenceLockTimeoutSQL); err != nil {
		return fmt.Errorf("migrations: remove the fence %s of %s: %w", downFence, l.schema, err)
	}
	for _, stmt := range l.sql.unfence {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("migrations: remove the fence %s of %s: %w", downFence, l.schema, err)
		}
	}
	return nil
}

func (l *schemaLock) Unlock(context.Context, *sql.DB) error {
	tx := l.held
	l.held = nil
	if tx == nil {
		return fmt.Errorf("migrations: unlock schema %s: not locked", l.schema)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("migrations: unlock schema %s: %w", l.schema, err)
	}
	return nil
}

// inSchema is FS with every migration's Up and Down opening with SET LOCAL search_path to the
// schema and SET LOCAL lock_timeout (lockWait): the SQL files name tables unqualified, and goose
// runs each migration in a transaction of its own, which through a transaction pooler is the only
// scope a setting is sure to have.
type inSchema struct {
	fs.FS
	preamble []byte
}

func (s inSchema) Open(name string) (fs.File, error) {
	f, err := s.FS.Open(name)
	if err != nil || !strings.HasSuffix(name, ".sql") {
		return f, err
	}
	defer f.Close()
	src, err := io.ReadAll(f)
	if err != nil {
		return nil, err
	}
	if bytes.Contains(src, []byte("+goose NO TRANSACTION")) {
		// SET LOCAL outside a transaction changes nothing: the file would run in whatever schema
		// the connection has.
		return nil, fmt.Errorf("migrations: %s runs outside a transaction, so it cannot be scoped to the schema", name)
	}
	var out bytes.Buffer
	for line := range bytes.Lines(src) {
		out.Write(line)
		if t := bytes.TrimSpace(line); bytes.Equal(t, []byte("-- +goose Up")) || bytes.Equal(t, []byte("-- +goose Down")) {
			out.Write(s.preamble)
		}
	}
	return &sqlFile{Reader: bytes.NewReader(out.Bytes()), name: name, size: int64(out.Len())}, nil
}

// sqlFile is a migration file rewritten by inSchema.
type sqlFile struct {
	*bytes.Reader
	name string
	size int64
}

func (f *sqlFile) Stat() (fs.FileInfo, error) { return f, nil }
func (f *sqlFile) Close() error               { return nil }
func (f *sqlFile) Name() string               { return path.Base(f.name) }
func (f *sqlFile) Size() int64                { return f.size }
func (f *sqlFile) Mode() fs.FileMode          { return 0o444 }
func (f *sqlFile) ModTime() time.Time         { return time.Time{} }
func (f *sqlFile) IsDir() bool                { return false }
func (f *sqlFile) Sys() any                   { return nil }
