// Package migrations holds txbox's database schema as goose SQL migrations and applies them.
//
// The tables are created in the first schema of the connection's search_path. To install txbox in
// its own schema, connect with search_path set to it (for example `?search_path=txbox` in the
// connection string, or `txbox migrate up --schema txbox`) and give the same schema to the outbox,
// inbox and relay configs.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"hash/crc64"
	"log/slog"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// FS holds the goose SQL files of this directory: the only definition of txbox's schema.
//
//go:embed *.sql
var FS embed.FS

// VersionTable is the name of goose's version table for txbox, distinct from goose's default so it
// cannot clash with an application's own goose migrations in the same schema.
const VersionTable = "txbox_goose_db_version"

// NewProvider returns a goose provider for txbox's migrations on db, with txbox's version table and
// a PostgreSQL session lock, so that two processes migrating the same schema at once take turns.
// Extra goose options (a logger, say) are appended.
func NewProvider(ctx context.Context, db *sql.DB, opts ...goose.ProviderOption) (*goose.Provider, error) {
	// One lock per database and schema: installs in different schemas do not wait for each other.
	var target string
	if err := db.QueryRowContext(ctx, `SELECT current_database() || '.' || coalesce(current_schema(), '')`).Scan(&target); err != nil {
		return nil, fmt.Errorf("migrations: find the target schema: %w", err)
	}
	lockID := int64(crc64.Checksum([]byte("txbox-migrations:"+target), crc64.MakeTable(crc64.ECMA)) >> 1)
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(lockID), lock.WithLockTimeout(1, 600))
	if err != nil {
		return nil, fmt.Errorf("migrations: session locker: %w", err)
	}
	base := []goose.ProviderOption{
		goose.WithTableName(VersionTable),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
		goose.WithSlog(slog.New(slog.DiscardHandler)),
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, FS, append(base, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

// Up applies every pending migration.
func Up(ctx context.Context, db *sql.DB, opts ...goose.ProviderOption) error {
	p, err := NewProvider(ctx, db, opts...)
	if err != nil {
		return err
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrations: up: %w", err)
	}
	return nil
}

// Down rolls back every applied migration, removing txbox's tables and everything in them.
func Down(ctx context.Context, db *sql.DB, opts ...goose.ProviderOption) error {
	p, err := NewProvider(ctx, db, opts...)
	if err != nil {
		return err
	}
	if _, err := p.DownTo(ctx, 0); err != nil {
		return fmt.Errorf("migrations: down: %w", err)
	}
	return nil
}
