package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/internal/age"
	"github.com/txbox/txbox/relay"
)

// outboxFilter is a relay.Filter as the outbox page's form and links carry it.
type outboxFilter struct {
	Shard, Kind, Topic, Key, Older string
	Failing                        bool
}

func (of outboxFilter) Link(after int64) string {
	q := url.Values{}
	for name, v := range map[string]string{"shard": of.Shard, "kind": of.Kind, "topic": of.Topic, "key": of.Key, "older": of.Older} {
		if v != "" {
			q.Set(name, v)
		}
	}
	if of.Failing {
		q.Set("failing", "on")
	}
	if after > 0 {
		q.Set("after", strconv.FormatInt(after, 10))
	}
	if len(q) == 0 {
		return "/outbox"
	}
	return "/outbox?" + q.Encode()
}

func parseOutboxFilter(q url.Values) (outboxFilter, relay.Filter, error) {
	of := outboxFilter{Shard: strings.TrimSpace(q.Get("shard")), Kind: q.Get("kind"), Topic: q.Get("topic"), Key: q.Get("key"),
		Older: strings.TrimSpace(q.Get("older")), Failing: q.Get("failing") != ""}
	f := relay.Filter{Kind: of.Kind, Topic: of.Topic, PartitionKey: of.Key, Failing: of.Failing}
	if of.Shard != "" {
		n, err := strconv.Atoi(of.Shard)
		if err != nil || n < 0 {
			return of, f, fmt.Errorf("shard: %q is not a shard number", of.Shard)
		}
		f.Shards = []int{n}
	}
	if of.Older != "" {
		d, err := age.Parse(of.Older)
		if err != nil {
			return of, f, fmt.Errorf("older than: %w", err)
		}
		f.OlderThan = d
	}
	if a := q.Get("after"); a != "" {
		n, err := strconv.ParseInt(a, 10, 64)
		if err != nil || n < 0 {
			return of, f, fmt.Errorf("after: %q is not a row id", a)
		}
		f.AfterID = n
	}
	return of, f, nil
}

const outboxPageSize = 100

type outboxView struct {
	Filter outboxFilter
	// Shards are the shards with rows pending or without a live owner (nothing publishes those).
	Shards  []relay.ShardBacklog
	Layout  int
	Rows    []relay.Row
	Next    string
	Error   string
	Pending int64
}

func (s *Server) outboxPage(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	of, f, err := parseOutboxFilter(r.URL.Query())
	v := outboxView{Filter: of}
	backlog, berr := s.outbox.Backlog(ctx, s.cfg.DB)
	if berr != nil {
		s.fail(w, r, http.StatusInternalServerError, "Reading the backlog failed: "+berr.Error())
		return
	}
	v.Layout = len(backlog)
	for _, b := range backlog {
		v.Pending += b.Messages + b.Calls
		if b.Messages+b.Calls > 0 || b.Owner == "" {
			v.Shards = append(v.Shards, b)
		}
	}
	if err == nil && len(f.Shards) == 1 && f.Shards[0] >= len(backlog) {
		err = fmt.Errorf("shard: the relays' layout has %d shards, 0 to %d", len(backlog), len(backlog)-1)
	}
	if err != nil {
		v.Error = err.Error()
		s.render(w, r, http.StatusBadRequest, "outbox.html", "Outbox", v, nil)
		return
	}
	f.Limit = outboxPageSize
	if v.Rows, err = s.outbox.List(ctx, s.cfg.DB, f); err != nil {
		s.fail(w, r, http.StatusInternalServerError, "Reading the outbox failed: "+err.Error())
		return
	}
	if len(v.Rows) == outboxPageSize {
		v.Next = of.Link(v.Rows[len(v.Rows)-1].ID)
	}
	s.render(w, r, http.StatusOK, "outbox.html", "Outbox", v, nil)
}

func (s *Server) outboxRowPage(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		s.fail(w, r, http.StatusNotFound, "There is no such outbox row.")
		return
	}
	row, err := s.outbox.Get(r.Context(), s.cfg.DB, id)
	switch {
	case errors.Is(err, relay.ErrRowNotFound):
		s.fail(w, r, http.StatusNotFound, fmt.Sprintf("Outbox row %d is not pending: it was published, executed or buried.", id))
		return
	case err != nil:
		s.fail(w, r, http.StatusInternalServerError, "Reading the row failed: "+err.Error())
		return
	}
	s.render(w, r, http.StatusOK, "outbox-row.html", fmt.Sprintf("Outbox row %d", id), row, nil)
}

// bury moves one pending row to the DLQ with the operator's reason (relay.Admin.Bury, which locks
// the shard's lease row like the relay) and audits it in the same transaction.
func (s *Server) bury(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	sess := operatorFrom(ctx)
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		s.fail(w, r, http.StatusNotFound, "There is no such outbox row.")
		return
	}
	back := fmt.Sprintf("/outbox/%d", id)
	reason := strings.TrimSpace(r.PostForm.Get("reason"))
	if reason == "" {
		s.sessions.setFlash(sess.id, "Nothing was buried: give a reason, for whoever reads the letter.")
		http.Redirect(w, r, back, http.StatusSeeOther)
		return
	}
	e := auditEntry{Operator: sess.operator, Action: "bury", Target: fmt.Sprintf("outbox row %d", id), Detail: reason}
	result, err := s.change(ctx, e, func(tx pgx.Tx) (string, error) {
		row, err := s.outbox.Bury(ctx, tx, id, "by "+sess.operator+" in the console: "+reason)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("moved %s %s (topic %q) to the DLQ", row.Kind, row.UUID, row.Topic), nil
	})
	if err != nil {
		s.sessions.setFlash(sess.id, "Nothing was buried: "+err.Error())
		http.Redirect(w, r, back, http.StatusSeeOther)
		return
	}
	s.sessions.setFlash(sess.id, fmt.Sprintf("Done: outbox row %d %s.", id, result))
	http.Redirect(w, r, "/outbox", http.StatusSeeOther)
}
