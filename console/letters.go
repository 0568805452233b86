package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/internal/age"
)

// letterFilter is a dlq.Filter as forms and links carry it: the text the operator typed.
type letterFilter struct {
	Source, Kind, Topic, Consumer, Handler, Reason, Older, Younger, IDs string
}

// letterFilterFields are the names of letterFilter's fields in forms and links, in its order.
var letterFilterFields = []string{"source", "kind", "topic", "consumer", "handler", "reason", "older", "younger", "id"}

func (lf letterFilter) values() []string {
	return []string{lf.Source, lf.Kind, lf.Topic, lf.Consumer, lf.Handler, lf.Reason, lf.Older, lf.Younger, lf.IDs}
}

// Empty reports whether the filter selects every letter.
func (lf letterFilter) Empty() bool {
	return !slices.ContainsFunc(lf.values(), func(v string) bool { return v != "" })
}

// WithKind is the filter narrowed to one kind of letter.
func (lf letterFilter) WithKind(kind string) letterFilter {
	lf.Kind = kind
	return lf
}

// Query is the filter as a query string, for links that keep it.
func (lf letterFilter) Query() url.Values {
	q := url.Values{}
	for i, v := range lf.values() {
		if v != "" {
			q.Set(letterFilterFields[i], v)
		}
	}
	return q
}

// Link is a page's path with the filter.
func (lf letterFilter) Link(path string) string {
	if q := lf.Query(); len(q) > 0 {
		return path + "?" + q.Encode()
	}
	return path
}

// String describes the filter for the audit: "consumer=billing reason=timeout".
func (lf letterFilter) String() string {
	var parts []string
	for i, v := range lf.values() {
		if v != "" {
			parts = append(parts, letterFilterFields[i]+"="+strconv.Quote(v))
		}
	}
	if len(parts) == 0 {
		return "letters: every letter"
	}
	return "letters: " + strings.Join(parts, " ")
}

// parseLetterFilter reads a filter from a query or form.
func parseLetterFilter(q url.Values) (letterFilter, dlq.Filter, error) {
	lf := letterFilter{
		Source: q.Get("source"), Kind: q.Get("kind"), Topic: q.Get("topic"), Consumer: q.Get("consumer"),
		Handler: q.Get("handler"), Reason: q.Get("reason"), Older: strings.TrimSpace(q.Get("older")),
		Younger: strings.TrimSpace(q.Get("younger")), IDs: strings.TrimSpace(q.Get("id")),
	}
	f := dlq.Filter{Source: dlq.Source(lf.Source), Kind: lf.Kind, Topic: lf.Topic, Consumer: lf.Consumer, Handler: lf.Handler, Reason: lf.Reason}
	var err error
	if lf.Older != "" {
		if f.OlderThan, err = age.Parse(lf.Older); err != nil {
			return lf, f, fmt.Errorf("older than: %w", err)
		}
	}
	if lf.Younger != "" {
		if f.YoungerThan, err = age.Parse(lf.Younger); err != nil {
			return lf, f, fmt.Errorf("younger than: %w", err)
		}
	}
	if lf.IDs != "" {
		for part := range strings.SplitSeq(lf.IDs, ",") {
			id, err := strconv.ParseInt(strings.TrimSpace(part), 10, 64)
			if err != nil || id <= 0 {
				return lf, f, fmt.Errorf("ids: %q is not a letter id", part)
			}
			f.IDs = append(f.IDs, id)
		}
	}
	switch {
	case f.Source != "" && f.Source != dlq.SourceInbox && f.Source != dlq.SourceRelay:
		return lf, f, fmt.Errorf("source must be inbox or relay")
	case f.Kind != "" && f.Kind != "message" && f.Kind != "call":
		return lf, f, fmt.Errorf("kind must be message or call")
	}
	return lf, f, nil
}

// Bounds of the letter list.
const (
	defaultListLimit = 100
	maxListLimit     = 1000
)

type lettersView struct {
	Filter  letterFilter
	Limit   int
	Letters []dlq.Letter
	Total   int
	// UpTo is the highest letter id when the page was made: a discard from the page is bounded by
	// it, so it cannot reach letters that failed after the operator looked.
	UpTo  int64
	Error string
}

func (s *Server) lettersPage(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	lf, f, err := parseLetterFilter(r.URL.Query())
	v := lettersView{Filter: lf, Limit: defaultListLimit}
	if l := r.URL.Query().Get("limit"); l != "" {
		n, perr := strconv.Atoi(l)
		if perr != nil || n < 1 || n > maxListLimit {
			err = errors.Join(err, fmt.Errorf("limit must be from 1 to %d", maxListLimit))
		} else {
			v.Limit = n
		}
	}
	if err != nil {
		v.Error = err.Error()
		s.render(w, r, http.StatusBadRequest, "letters.html", "Dead letters", v, nil)
		return
	}
	f.Limit = v.Limit
	if v.UpTo, err = s.letters.MaxID(ctx, s.cfg.DB); err == nil {
		f.MaxID = v.UpTo
		v.Letters, err = s.letters.List(ctx, s.cfg.DB, f)
	}
	if err == nil {
		v.Total = len(v.Letters)
		if v.Total == f.Limit {
			f.Limit = 0
			v.Total, err = s.letters.Count(ctx, s.cfg.DB, f)
		}
	}
	if err != nil {
		s.fail(w, r, http.StatusInternalServerError, "Reading the dead letters failed: "+err.Error())
		return
	}
	s.render(w, r, http.StatusOK, "letters.html", "Dead letters", v, nil)
}

type letterView struct {
	dlq.Letter
	// Single is the filter that selects this letter alone.
	Single letterFilter
}

func (s *Server) letterPage(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		s.fail(w, r, http.StatusNotFound, "There is no such letter.")
		return
	}
	l, err := s.letters.Get(r.Context(), s.cfg.DB, id)
	switch {
	case errors.Is(err, dlq.ErrNotFound):
		s.fail(w, r, http.StatusNotFound, fmt.Sprintf("Letter %d is not in the dead-letter table: it was redriven or discarded.", id))
		return
	case err != nil:
		s.fail(w, r, http.StatusInternalServerError, "Reading the letter failed: "+err.Error())
		return
	}
	s.render(w, r, http.StatusOK, "letter.html", fmt.Sprintf("Letter %d", id), letterView{Letter: l, Single: letterFilter{IDs: strconv.FormatInt(id, 10)}}, nil)
}

// errSelectionChanged refuses a change to a selection that is not what the operator saw.
type errSelectionChanged struct{ now, seen int }

func (e errSelectionChanged) Error() string {
	return fmt.Sprintf("the selection holds %d letter(s) now, not the %d you saw; nothing was changed: look again", e.now, e.seen)
}

// discard deletes the letters a filter selects, if they are as many as the operator saw, and
// audits it in the same transaction. A selection by filter is bounded by the highest letter id
// when the page was made: a count alone let letters that failed after the operator looked take the
// place of letters redriven meanwhile, and be discarded unseen.
func (s *Server) discard(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	sess := operatorFrom(ctx)
	lf, f, err := parseLetterFilter(r.PostForm)
	back := lf.Link("/letters")
	if len(f.IDs) == 1 {
		back = "/letters"
	}
	seen, serr := strconv.Atoi(r.PostForm.Get("expect"))
	upTo, uerr := strconv.ParseInt(r.PostForm.Get("upto"), 10, 64)
	switch {
	case err != nil:
	case serr != nil || seen < 1:
		err = errors.New("the form does not say how many letters you saw")
	case len(f.IDs) == 0 && (uerr != nil || upTo < 1):
		err = errors.New("the form does not say which letters you saw")
	case f.IsEmpty():
		err = errors.New("choose a filter first: the console never discards every letter at once")
	}
	if err != nil {
		s.sessions.setFlash(sess.id, "Nothing was discarded: "+err.Error())
		http.Redirect(w, r, back, http.StatusSeeOther)
		return
	}
	detail := fmt.Sprintf("%d letter(s) seen", seen)
	if len(f.IDs) == 0 {
		f.MaxID = upTo
		detail += fmt.Sprintf(", ids up to %d", upTo)
	}
	e := auditEntry{Operator: sess.operator, Action: "discard", Target: lf.String(), Detail: detail}
	result, err := s.change(ctx, e, func(tx pgx.Tx) (string, error) {
		n, err := s.letters.Discard(ctx, tx, f)
		if err != nil {
			return "", err
		}
		if n != seen {
			return "", errSelectionChanged{now: n, seen: seen}
		}
		return fmt.Sprintf("discarded %d letter(s)", n), nil
	})
	if err != nil {
		s.sessions.setFlash(sess.id, "Nothing was discarded: "+err.Error())
		http.Redirect(w, r, back, http.StatusSeeOther)
		return
	}
	s.sessions.setFlash(sess.id, "Done: "+result+".")
	http.Redirect(w, r, back, http.StatusSeeOther)
}

// redriveForm is the pacing an operator chose, as typed.
type redriveForm struct {
	Rate, Burst, Batch string
}

// options reads the pacing with the bounds of txbox dlq redrive's flags.
func (rf redriveForm) options() (dlq.RedriveOptions, error) {
	opts := dlq.RedriveOptions{BatchSize: dlq.DefaultRedriveBatchSize}
	if rf.Rate != "" {
		r, err := strconv.ParseFloat(rf.Rate, 64)
		if err != nil || !(r >= 0.001 && r <= 100_000) {
			return opts, fmt.Errorf("rate must be a number of letters per second from 0.001 to 100000, got %q", rf.Rate)
		}
		opts.Rate = rate.Limit(r)
	}
	if rf.Batch != "" {
		n, err := strconv.Atoi(rf.Batch)
		if err != nil || n < 1 || n > 10_000 {
			return opts, fmt.Errorf("batch size must be from 1 to 10000, got %q", rf.Batch)
		}
		opts.BatchSize = n
	}
	if rf.Burst != "" {
		n, err := strconv.Atoi(rf.Burst)
		if err != nil || n < 1 || n > opts.BatchSize {
			return opts, fmt.Errorf("burst must be from 1 to the batch size (%d), got %q", opts.BatchSize, rf.Burst)
		}
		opts.Burst = n
	}
	return opts, nil
}

type redrivePlanView struct {
	Filter     letterFilter
	Form       redriveForm
	Plan       dlq.RedriveResult
	Sample     []dlq.Letter
	Error      string
	Calls      bool // the selection holds call letters, which cannot be redriven
	NeedsRate  bool
	MaxUnpaced int
	Running    *redriveStatus
	Took       string // how long the redrive takes at the form's rate
}

const redriveSample = 20

// planRedrive is the dry run of a redrive: dlq.Admin.Redrive with DryRun, refusing what a real run
// refuses (calls, an empty filter), and a sample of the letters.
func (s *Server) planRedrive(r *http.Request, form url.Values) (redrivePlanView, dlq.Filter, error) {
	ctx := r.Context()
	lf, f, err := parseLetterFilter(form)
	v := redrivePlanView{Filter: lf, MaxUnpaced: dlq.MaxUnpacedRedrive, Running: s.redrives.running(),
		Form: redriveForm{Rate: form.Get("rate"), Burst: form.Get("burst"), Batch: form.Get("batch")}}
	if err != nil {
		return v, f, err
	}
	if f.IsEmpty() {
		return v, f, errors.New("choose a filter first: the console never redrives every letter at once")
	}
	v.Plan, err = s.letters.Redrive(ctx, s.cfg.DB, f, dlq.RedriveOptions{Rate: rate.Inf, DryRun: true})
	if err != nil {
		v.Calls = errors.Is(err, dlq.ErrCallNotRedrivable)
		return v, f, err
	}
	v.NeedsRate = v.Plan.Planned > dlq.MaxUnpacedRedrive
	sample := f
	sample.Limit = redriveSample
	if v.Sample, err = s.letters.List(ctx, s.cfg.DB, sample); err != nil {
		return v, f, err
	}
	if opts, err := v.Form.options(); err == nil && opts.Rate > 0 && v.Plan.Planned > 0 {
		v.Took = age.Format(time.Duration(float64(v.Plan.Planned) / float64(opts.Rate) * float64(time.Second)))
	}
	return v, f, nil
}

func (s *Server) redrivePlanPage(w http.ResponseWriter, r *http.Request) {
	v, _, err := s.planRedrive(r, r.URL.Query())
	status := http.StatusOK
	if err != nil {
		v.Error, status = err.Error(), http.StatusBadRequest
	}
	s.render(w, r, status, "redrive-plan.html", "Redrive: dry run", v, nil)
}

// startRedrive plans the redrive again, checks it is what the operator saw, applies the same
// pacing rule as txbox dlq redrive (dlq.PaceFor), audits its start and runs it in the background.
func (s *Server) startRedrive(w http.ResponseWriter, r *http.Request) {
	sess := operatorFrom(r.Context())
	v, f, err := s.planRedrive(r, r.PostForm)
	back := v.Filter.Link("/letters/redrive")
	refuse := func(err error) {
		_ = s.auditAlone(r.Context(), auditEntry{Operator: sess.operator, Action: "redrive", Target: v.Filter.String(),
			Detail: r.PostForm.Get("expect") + " letter(s) seen", Result: "refused: " + err.Error()})
		s.sessions.setFlash(sess.id, "The redrive did not start: "+err.Error())
		http.Redirect(w, r, back, http.StatusSeeOther)
	}
	if err != nil {
		refuse(err)
		return
	}
	opts, err := v.Form.options()
	if err != nil {
		refuse(err)
		return
	}
	if seen, err := strconv.Atoi(r.PostForm.Get("expect")); err != nil || seen != v.Plan.Planned {
		refuse(errSelectionChanged{now: v.Plan.Planned, seen: seen})
		return
	}
	if v.Plan.Planned == 0 {
		refuse(errors.New("no letters match"))
		return
	}
	f, opts, err = dlq.PaceFor(f, v.Plan, opts)
	if err != nil {
		refuse(fmt.Errorf("%d letters match; redriving more than %d needs a rate (letters per second), because every consumer of their topics and the APIs they call see them as new traffic",
			v.Plan.Planned, dlq.MaxUnpacedRedrive))
		return
	}
	run, err := s.redrives.start(s, sess.operator, v.Filter, f, v.Plan, opts)
	if err != nil {
		refuse(err)
		return
	}
	http.Redirect(w, r, fmt.Sprintf("/redrives/%d", run.id), http.StatusSeeOther)
}
