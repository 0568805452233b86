package console

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// auditEntry is one row of txbox_console_audit.
type auditEntry struct {
	ID       int64
	At       time.Time
	Operator string
	Action   string
	Target   string
	Detail   string
	Result   string
}

type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// audit writes e through db: the transaction of the change it records, so that the change and its
// record commit together or not at all.
func (s *Server) audit(ctx context.Context, db execer, e auditEntry) error {
	if _, err := db.Exec(ctx, s.sql.insertAudit, e.Operator, e.Action, e.Target, e.Detail, e.Result); err != nil {
		return fmt.Errorf("console: audit: %w", err)
	}
	return nil
}

// logAudit writes an audited action to the log once it committed.
func (s *Server) logAudit(e auditEntry) {
	s.log.Info("console: "+e.Action, "operator", e.Operator, "target", e.Target, "detail", e.Detail, "result", e.Result)
}

// auditAlone writes e in a transaction of its own: for what is not a change of the database (a
// sign-in), for a change that failed and was rolled back, and for a redrive, whose batches commit
// one by one. It must outlive a request that was cancelled meanwhile.
func (s *Server) auditAlone(ctx context.Context, e auditEntry) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := s.audit(ctx, s.cfg.DB, e)
	if err == nil {
		s.logAudit(e)
	} else {
		s.log.Error("console: the audit row could not be written", "operator", e.Operator, "action", e.Action,
			"target", e.Target, "result", e.Result, "error", err)
	}
	return err
}

// change runs fn, which changes the database through tx, and writes its audit row in the same
// transaction. When fn fails the transaction rolls back and the failure is audited on its own.
// fn returns the result to record.
func (s *Server) change(ctx context.Context, e auditEntry, fn func(tx pgx.Tx) (string, error)) (string, error) {
	var result string
	err := pgx.BeginFunc(ctx, s.cfg.DB, func(tx pgx.Tx) error {
		var err error
		if result, err = fn(tx); err != nil {
			return err
		}
		e.Result = result
		return s.audit(ctx, tx, e)
	})
	if err != nil {
		e.Result = "failed: " + err.Error()
		_ = s.auditAlone(ctx, e)
		return "", err
	}
	s.logAudit(e)
	return result, nil
}

func (s *Server) auditPage(w http.ResponseWriter, r *http.Request) {
	rows, err := s.cfg.DB.Query(r.Context(), s.sql.listAudit, 500)
	if err != nil {
		s.fail(w, r, http.StatusInternalServerError, "Reading the audit failed: "+err.Error())
		return
	}
	entries, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (auditEntry, error) {
		var e auditEntry
		err := row.Scan(&e.ID, &e.At, &e.Operator, &e.Action, &e.Target, &e.Detail, &e.Result)
		return e, err
	})
	if err != nil {
		s.fail(w, r, http.StatusInternalServerError, "Reading the audit failed: "+err.Error())
		return
	}
	s.render(w, r, http.StatusOK, "audit.html", "Audit", entries, nil)
}
