package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
)

// SQLExecer is the part of database/sql the outbox needs: *sql.Tx, *sql.Conn and *sql.DB have it,
// and so do the transactions of libraries built on database/sql (sqlx, sqlc's database/sql mode).
type SQLExecer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// FromSQL lets Publish and Call write through a database/sql transaction, for services that use
// database/sql rather than pgx directly:
//
//	tx, _ := db.BeginTx(ctx, nil)                     // db opened with sql.Open("pgx", url)
//	_ = w.Publish(ctx, outbox.FromSQL(tx), "orders", msg)
//	_ = tx.Commit()
//
// The database must be opened through pgx's driver (github.com/jackc/pgx/v5/stdlib, driver name
// "pgx"). Other drivers are not refused, but lib/pq, for one, fails in three ways: it refuses the
// arrays a Publish of several messages passes; its errors are not pgx's, so ErrSchemaOutdated and
// ErrInvalidCall are not recognised; and through a *sql.DB, a connection lost after PostgreSQL ran
// the INSERT is reported to database/sql as one it may retry, which writes the rows twice.
//
// A context that ends while a statement is on its way is reported as context.Canceled or
// context.DeadlineExceeded, even where pgx's driver says "bad connection" so that database/sql
// may retry a statement that was never sent.
func FromSQL(tx SQLExecer) Execer {
	return sqlExecer{tx}
}

type sqlExecer struct{ tx SQLExecer }

// Exec returns the rows affected in its tag, which Call reads (the statement is an INSERT).
func (e sqlExecer) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	res, err := e.tx.ExecContext(ctx, query, args...)
	if errors.Is(err, driver.ErrBadConn) && ctx.Err() != nil {
		// pgx's driver reports a context that ended before the statement was sent as a bad
		// connection, so that database/sql may retry elsewhere; in a transaction it cannot, and
		// the caller, who branches on context.Canceled or DeadlineExceeded, would see neither.
		return pgconn.CommandTag{}, fmt.Errorf("%w (the driver reports %v)", ctx.Err(), err)
	}
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return pgconn.NewCommandTag(fmt.Sprintf("INSERT 0 %d", n)), nil
}
