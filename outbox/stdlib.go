package outbox

import (
	"context"
	"database/sql"
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
// "pgx"): a Publish of several messages passes arrays, which pgx's driver hands to PostgreSQL as
// they are and drivers such as lib/pq refuse.
func FromSQL(tx SQLExecer) Execer {
	return sqlExecer{tx}
}

type sqlExecer struct{ tx SQLExecer }

// Exec returns the rows affected in its tag, which Call reads (the statement is an INSERT).
func (e sqlExecer) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	res, err := e.tx.ExecContext(ctx, query, args...)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return pgconn.NewCommandTag(fmt.Sprintf("INSERT 0 %d", n)), nil
}
