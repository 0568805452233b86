package console

import "net/http"

// TEMPORARY until package status lands.
func (s *Server) overviewPage(w http.ResponseWriter, r *http.Request) {
	s.render(w, r, http.StatusOK, "overview.html", "Overview", nil, nil)
}

func (s *Server) statusJSON(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{})
}
