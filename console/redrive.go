package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
)

// keptRedrives is how many finished redrives the console remembers for their pages.
const keptRedrives = 50

// redrives runs redrives in the background, one at a time: two at once would add their rates up,
// which is what pacing is there to prevent.
type redrives struct {
	base context.Context
	stop context.CancelFunc
	wg   sync.WaitGroup

	mu     sync.Mutex
	closed bool
	nextID int
	runs   []*redriveRun // oldest first
}

func newRedrives() *redrives {
	base, stop := context.WithCancel(context.Background())
	return &redrives{base: base, stop: stop}
}

// redriveRun is one redrive started from the console.
type redriveRun struct {
	id       int
	operator string
	filter   letterFilter
	planned  int
	pace     string
	started  time.Time
	cancel   context.CancelFunc

	mu          sync.Mutex
	moved       int
	released    int
	elapsed     time.Duration
	state       string // running, done, stopped, failed
	err         string
	cancelledBy string
}

// redriveStatus is a redrive as its page and its JSON show it.
type redriveStatus struct {
	ID          int     `json:"id"`
	Operator    string  `json:"operator"`
	Target      string  `json:"target"`
	Link        string  `json:"-"`
	Pace        string  `json:"pace"`
	Started     string  `json:"started"`
	State       string  `json:"state"`
	Planned     int     `json:"planned"`
	Moved       int     `json:"moved"`
	Released    int     `json:"released"`
	Elapsed     float64 `json:"elapsed_seconds"`
	Error       string  `json:"error"`
	CancelledBy string  `json:"cancelled_by"`
}

func (run *redriveRun) status() redriveStatus {
	run.mu.Lock()
	defer run.mu.Unlock()
	if run.state == "running" {
		run.elapsed = time.Since(run.started)
	}
	return redriveStatus{
		ID: run.id, Operator: run.operator, Target: run.filter.String(), Link: run.filter.Link("/letters"), Pace: run.pace,
		Started: showTime(run.started), State: run.state, Planned: run.planned, Moved: run.moved, Released: run.released,
		Elapsed: run.elapsed.Seconds(), Error: run.err, CancelledBy: run.cancelledBy,
	}
}

func describePace(opts dlq.RedriveOptions) string {
	if opts.Rate == rate.Inf {
		return "unpaced (at most " + strconv.Itoa(dlq.MaxUnpacedRedrive) + " letters)"
	}
	return strconv.FormatFloat(float64(opts.Rate), 'g', -1, 64) + " letters/s"
}

var errRedriveRunning = errors.New("another redrive is running: wait for it or stop it first")

// start audits the redrive's start and runs it: dlq.Admin.Redrive with the operator's filter and
// options, its progress kept for the redrive's page. Its batches commit one by one, so its audit
// is a row when it starts, written before the first letter moves, and a row when it ends.
func (rs *redrives) start(s *Server, operator string, lf letterFilter, f dlq.Filter, plan dlq.RedriveResult, opts dlq.RedriveOptions) (*redriveRun, error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.closed {
		return nil, errors.New("the console is stopping")
	}
	if len(rs.runs) > 0 && rs.runs[len(rs.runs)-1].status().State == "running" {
		return nil, errRedriveRunning
	}
	rs.nextID++
	ctx, cancel := context.WithCancel(rs.base)
	run := &redriveRun{id: rs.nextID, operator: operator, filter: lf, planned: plan.Planned, pace: describePace(opts),
		started: time.Now(), cancel: cancel, state: "running"}
	detail := fmt.Sprintf("redrive #%d: %d letter(s) planned, %s", run.id, plan.Planned, run.pace)
	if err := s.auditAlone(ctx, auditEntry{Operator: operator, Action: "redrive", Target: lf.String(), Detail: detail, Result: "started"}); err != nil {
		cancel()
		return nil, fmt.Errorf("its start could not be audited, so it did not start: %w", err)
	}
	rs.runs = append(rs.runs, run)
	if len(rs.runs) > keptRedrives {
		rs.runs = rs.runs[1:]
	}
	opts.Progress = func(p dlq.RedriveProgress) {
		run.mu.Lock()
		run.moved = p.Moved
		run.mu.Unlock()
	}
	rs.wg.Go(func() {
		defer cancel()
		res, err := s.letters.Redrive(ctx, s.cfg.DB, f, opts)
		var state, result string
		switch {
		case err == nil:
			state = "done"
			result = fmt.Sprintf("moved %d of %d letter(s), released %d dead inbox row(s), in %s", res.Moved, res.Planned, res.Released,
				res.Elapsed.Round(time.Millisecond))
		case errors.Is(err, context.Canceled):
			state = "stopped"
			run.mu.Lock()
			who := run.cancelledBy
			run.mu.Unlock()
			if who == "" {
				who = "the console stopping"
			}
			result = fmt.Sprintf("stopped by %s after %d of %d letter(s); the rest are still in the DLQ", who, res.Moved, res.Planned)
		default:
			state = "failed"
			result = fmt.Sprintf("failed after %d of %d letter(s): %v", res.Moved, res.Planned, err)
		}
		// Audited before the run shows its end, so whoever sees it ended finds its audit row too.
		_ = s.auditAlone(rs.base, auditEntry{Operator: operator, Action: "redrive", Target: lf.String(), Detail: detail, Result: result})
		run.mu.Lock()
		run.moved, run.released, run.elapsed = res.Moved, res.Released, time.Since(run.started)
		run.state = state
		if state == "failed" {
			run.err = err.Error()
		}
		run.mu.Unlock()
	})
	return run, nil
}

// running returns the redrive that is running, if one is.
func (rs *redrives) running() *redriveStatus {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if len(rs.runs) == 0 {
		return nil
	}
	if st := rs.runs[len(rs.runs)-1].status(); st.State == "running" {
		return &st
	}
	return nil
}

func (rs *redrives) get(id int) (*redriveRun, bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	for _, run := range rs.runs {
		if run.id == id {
			return run, true
		}
	}
	return nil, false
}

// all returns the remembered redrives, the newest first.
func (rs *redrives) all() []redriveStatus {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	out := make([]redriveStatus, 0, len(rs.runs))
	for i := len(rs.runs) - 1; i >= 0; i-- {
		out = append(out, rs.runs[i].status())
	}
	return out
}

func (rs *redrives) close() {
	rs.mu.Lock()
	rs.closed = true
	rs.mu.Unlock()
	rs.stop()
	rs.wg.Wait()
}

func (s *Server) redriveRun(w http.ResponseWriter, r *http.Request) (*redriveRun, bool) {
	id, err := strconv.Atoi(r.PathValue("id"))
	run, ok := s.redrives.get(id)
	if err != nil || !ok {
		s.fail(w, r, http.StatusNotFound, "This console does not know that redrive: it remembers the last ones it ran since it started.")
		return nil, false
	}
	return run, true
}

func (s *Server) redrivePage(w http.ResponseWriter, r *http.Request) {
	if run, ok := s.redriveRun(w, r); ok {
		st := run.status()
		s.render(w, r, http.StatusOK, "redrive.html", fmt.Sprintf("Redrive #%d", st.ID), st, nil)
	}
}

func (s *Server) redrivesPage(w http.ResponseWriter, r *http.Request) {
	s.render(w, r, http.StatusOK, "redrives.html", "Redrives", s.redrives.all(), nil)
}

func (s *Server) redriveJSON(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.Atoi(r.PathValue("id"))
	run, ok := s.redrives.get(id)
	if err != nil || !ok {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such redrive"})
		return
	}
	writeJSON(w, http.StatusOK, run.status())
}

// cancelRedrive stops a running redrive between two batches (or rolls its current batch back).
func (s *Server) cancelRedrive(w http.ResponseWriter, r *http.Request) {
	run, ok := s.redriveRun(w, r)
	if !ok {
		return
	}
	sess := operatorFrom(r.Context())
	run.mu.Lock()
	running := run.state == "running"
	if running && run.cancelledBy == "" {
		run.cancelledBy = sess.operator
	}
	run.mu.Unlock()
	if running {
		_ = s.auditAlone(r.Context(), auditEntry{Operator: sess.operator, Action: "stop redrive", Target: fmt.Sprintf("redrive #%d", run.id),
			Result: "requested"})
		run.cancel()
		s.sessions.setFlash(sess.id, "Stopping the redrive: the batch in flight finishes or rolls back.")
	}
	http.Redirect(w, r, fmt.Sprintf("/redrives/%d", run.id), http.StatusSeeOther)
}
