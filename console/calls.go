package console

import (
	"net/http"
	"strings"

	"github.com/txbox/txbox/relay"
)

type callsView struct {
	Key, Object string
	Searched    bool
	Results     []relay.CallResult
	Error       string
}

// callsPage looks call results up by idempotency key or provider object id, for reconciliation
// (relay.Admin.CallResults).
func (s *Server) callsPage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	v := callsView{Key: strings.TrimSpace(q.Get("key")), Object: strings.TrimSpace(q.Get("object"))}
	if v.Key != "" || v.Object != "" {
		v.Searched = true
		var err error
		if v.Results, err = s.outbox.CallResults(r.Context(), s.cfg.DB, relay.CallResultQuery{IdempotencyKey: v.Key, ObjectID: v.Object}); err != nil {
			s.fail(w, r, http.StatusInternalServerError, "Looking the call up failed: "+err.Error())
			return
		}
	}
	s.render(w, r, http.StatusOK, "calls.html", "Call results", v, nil)
}
