package console

import (
	"net/http"

	"github.com/txbox/txbox/status"
)

// overviewPage is the frame of the overview; its script fills it from /api/status and refreshes it
// every Config.Refresh.
func (s *Server) overviewPage(w http.ResponseWriter, r *http.Request) {
	s.render(w, r, http.StatusOK, "overview.html", "Overview", nil, nil)
}

// statusJSON serves status.Read's snapshot, exactly as `txbox status --json` prints it.
func (s *Server) statusJSON(w http.ResponseWriter, r *http.Request) {
	rep, err := status.Read(r.Context(), s.cfg.DB, status.Options{Schema: s.cfg.Schema, Window: s.cfg.Window})
	if err != nil {
		s.log.Error("console: status", "error", err)
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, rep)
}
