package console_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
)

type redriveJSON struct {
	ID       int     `json:"id"`
	State    string  `json:"state"`
	Planned  int     `json:"planned"`
	Moved    int     `json:"moved"`
	Released int     `json:"released"`
	Elapsed  float64 `json:"elapsed_seconds"`
	Error    string  `json:"error"`
}

// inboxLetter adds a letter a consumer gave up on, with the 'dead' inbox row the inbox writes
// beside it.
func (b *bundle) inboxLetter(t *testing.T, uuid, topic, reason string) int64 {
	t.Helper()
	id := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: topic, Consumer: "billing", Handler: "charge", DedupKey: uuid,
		UUID: uuid, Payload: []byte(`{"order":"` + uuid + `"}`), Reason: reason})
	_, err := b.env.Pool.Exec(context.Background(), `INSERT INTO `+b.env.Q("txbox_inbox")+
		` (consumer, handler, dedup_key, message_uuid, topic, state) VALUES ('billing', 'charge', $1, $1, $2, 'dead')`, uuid, topic)
	require.NoError(t, err)
	return id
}

// startRedrive posts the plan page's form and returns the redrive's page.
func (br *browser) startRedrive(csrf string, form url.Values) page {
	br.t.Helper()
	form.Set("csrf", csrf)
	res := br.post("/letters/redrive", form, nil)
	require.Equal(br.t, http.StatusSeeOther, res.status, res.body)
	return res
}

func (br *browser) waitRedrive(location string) redriveJSON {
	br.t.Helper()
	var st redriveJSON
	require.Eventually(br.t, func() bool {
		br.getJSON("/api"+location, &st)
		return st.State != "running"
	}, 30*time.Second, 20*time.Millisecond)
	return st
}

// A redrive from the console is dlq.Admin.Redrive: a dry run first, then the letters go back
// through the outbox, their dead inbox rows are released, and its start and end are audited.
func TestRedriveFromTheConsole(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i := range 3 {
		b.inboxLetter(t, fmt.Sprint("m-", i), "orders", "attempts exhausted")
	}
	b.inboxLetter(t, "other", "invoices", "payload too large")
	br := b.browser(t)

	plan := br.get("/letters/redrive?consumer=billing&reason=attempts")
	require.Equal(t, http.StatusOK, plan.status)
	require.Contains(t, plan.body, `<strong id="planned">3</strong>`)
	require.Contains(t, plan.body, "Nothing has moved.")
	require.NotContains(t, plan.body, `id="redrive-form"`, "not signed in: no form")
	require.Equal(t, 4, b.count(t, "txbox_dlq", "true"), "the dry run moved nothing")

	csrf := br.mustSignIn("alice")
	plan = br.get("/letters/redrive?consumer=billing&reason=attempts")
	require.Contains(t, plan.body, `id="redrive-form"`)
	require.Contains(t, plan.body, `name="expect" value="3"`)
	res := br.startRedrive(csrf, url.Values{"consumer": {"billing"}, "reason": {"attempts"}, "expect": {"3"}, "rate": {"1000"}})
	location := res.header.Get("Location")
	require.Regexp(t, `^/redrives/\d+$`, location)

	st := br.waitRedrive(location)
	require.Equal(t, "done", st.State, st.Error)
	require.Equal(t, 3, st.Planned)
	require.Equal(t, 3, st.Moved)
	require.Equal(t, 3, st.Released)
	require.Equal(t, 3, b.count(t, "txbox_outbox", "topic = 'orders'"))
	require.Equal(t, 1, b.count(t, "txbox_dlq", "true"), "only the selection moved")
	require.Zero(t, b.count(t, "txbox_inbox", "state = 'dead' AND topic = 'orders'"))
	page := br.get(location)
	require.Contains(t, page.body, `id="redrive-state">done`)
	require.Contains(t, br.get("/redrives").body, location)

	audit := b.audit(t)
	require.Len(t, audit, 3) // sign in, redrive started, redrive finished
	target := `letters: consumer="billing" reason="attempts"`
	require.Equal(t, auditRow{Operator: "alice", Action: "redrive", Target: target, Detail: "redrive #1: 3 letter(s) planned, 1000 letters/s",
		Result: "started"}, audit[1])
	require.Equal(t, "redrive", audit[2].Action)
	require.Equal(t, target, audit[2].Target)
	require.True(t, strings.HasPrefix(audit[2].Result, "moved 3 of 3 letter(s), released 3 dead inbox row(s)"), audit[2].Result)
}

// The console refuses what txbox dlq redrive refuses: call letters, more than
// dlq.MaxUnpacedRedrive letters without a rate, an empty filter; and a selection that changed
// since the dry run.
func TestRedriveRefusesWhatTheCLIRefuses(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	call := b.addLetter(t, dlq.Entry{Source: dlq.SourceRelay, Kind: "call", Topic: "charges.replies", UUID: "c-1",
		IdempotencyKey: "txbox_abc", Reason: "replay window passed"})
	b.addLetter(t, dlq.Entry{Source: dlq.SourceRelay, Topic: "orders", UUID: "r-1", Reason: "rejected by broker"})
	br := b.browser(t)
	csrf := br.mustSignIn("alice")

	plan := br.get("/letters/redrive?source=relay")
	require.Equal(t, http.StatusBadRequest, plan.status)
	require.Contains(t, plan.body, "side-effect calls cannot be redriven")
	require.Contains(t, plan.body, fmt.Sprintf("ids %d", call))
	require.Contains(t, plan.body, `href="/letters/redrive?kind=message&amp;source=relay"`)
	br.startRedrive(csrf, url.Values{"source": {"relay"}, "expect": {"2"}})
	require.Contains(t, br.get("/letters").body, "The redrive did not start: dlq: side-effect calls cannot be redriven")
	audit := b.audit(t)
	require.Equal(t, "redrive", audit[len(audit)-1].Action, "a refused redrive is audited")
	require.Equal(t, "alice", audit[len(audit)-1].Operator)
	require.Contains(t, audit[len(audit)-1].Result, "refused: dlq: side-effect calls cannot be redriven")
	letter := br.get(fmt.Sprintf("/letters/%d", call)).body
	require.Contains(t, letter, `id="call-note"`)
	require.NotContains(t, letter, `id="redrive-one"`)
	require.Contains(t, letter, `href="/calls?key=txbox_abc"`)

	require.Equal(t, http.StatusBadRequest, br.get("/letters/redrive").status)
	br.startRedrive(csrf, url.Values{"expect": {"2"}})
	require.Contains(t, br.get("/letters").body, "choose a filter first")

	_, err := b.env.Pool.Exec(ctx, `INSERT INTO `+b.env.Q("txbox_dlq")+` (source, topic, uuid, payload, reason)
		SELECT 'inbox', 'bulk', 'b-' || g, '', 'timeout' FROM generate_series(1, $1::int) AS g`, dlq.MaxUnpacedRedrive+1)
	require.NoError(t, err)
	plan = br.get("/letters/redrive?topic=bulk")
	require.Contains(t, plan.body, fmt.Sprintf("required: more than %d letters", dlq.MaxUnpacedRedrive))
	br.startRedrive(csrf, url.Values{"topic": {"bulk"}, "expect": {fmt.Sprint(dlq.MaxUnpacedRedrive + 1)}})
	require.Contains(t, br.get("/letters").body, "needs a rate (letters per second)")
	br.startRedrive(csrf, url.Values{"topic": {"bulk"}, "expect": {"7"}, "rate": {"100000"}})
	require.Contains(t, br.get("/letters").body, fmt.Sprintf("the selection holds %d letter(s) now, not the 7 you saw", dlq.MaxUnpacedRedrive+1))
	br.startRedrive(csrf, url.Values{"topic": {"bulk"}, "expect": {fmt.Sprint(dlq.MaxUnpacedRedrive + 1)}, "rate": {"100000"}, "burst": {"500"}, "batch": {"100"}})
	require.Contains(t, br.get("/letters").body, "burst must be from 1 to the batch size (100)")
	require.Equal(t, dlq.MaxUnpacedRedrive+3, b.count(t, "txbox_dlq", "true"), "nothing moved")
	require.Zero(t, b.count(t, "txbox_outbox", "true"))
	refusals := 0
	for _, a := range b.audit(t) {
		if a.Action == "redrive" {
			require.True(t, strings.HasPrefix(a.Result, "refused: "), "nothing started, only refusals are audited: %+v", a)
			refusals++
		}
	}
	require.Equal(t, 5, refusals, "every refused start is audited")

	// Without a rate, up to the limit moves at once: exactly the letters counted.
	res := br.startRedrive(csrf, url.Values{"source": {"relay"}, "kind": {"message"}, "expect": {"1"}})
	st := br.waitRedrive(res.header.Get("Location"))
	require.Equal(t, "done", st.State)
	require.Equal(t, 1, st.Moved)
	require.Equal(t, 1, b.count(t, "txbox_outbox", "topic = 'orders'"))
}

// A paced redrive shows its progress, can be stopped by an operator, and only one runs at a time.
func TestRedriveProgressAndStop(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	const n = 40
	for i := range n {
		b.inboxLetter(t, fmt.Sprint("m-", i), "orders", "timeout")
	}
	br := b.browser(t)
	csrf := br.mustSignIn("alice")
	// 4 letters a second, one per batch: the redrive would take 10 s, time to watch and stop it.
	res := br.startRedrive(csrf, url.Values{"topic": {"orders"}, "expect": {fmt.Sprint(n)}, "rate": {"4"}, "batch": {"1"}, "burst": {"1"}})
	location := res.header.Get("Location")
	var st redriveJSON
	require.Eventually(t, func() bool {
		br.getJSON("/api"+location, &st)
		return st.Moved > 0
	}, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, "running", st.State)
	page := br.get(location)
	require.Contains(t, page.body, `data-state="running"`)
	require.Contains(t, page.body, `id="redrive-stop"`)
	require.Contains(t, br.get("/letters/redrive?topic=orders").body, `id="running"`)

	second := br.startRedrive(csrf, url.Values{"id": {fmt.Sprint(n)}, "expect": {"1"}}) // the last letter moves last
	require.Contains(t, second.header.Get("Location"), "/letters/redrive")
	require.Contains(t, br.get("/letters").body, "another redrive is running")

	require.Equal(t, http.StatusSeeOther, br.post(location+"/stop", url.Values{"csrf": {csrf}}, nil).status)
	st = br.waitRedrive(location)
	require.Equal(t, "stopped", st.State)
	require.Less(t, st.Moved, n)
	require.Equal(t, n-st.Moved, b.count(t, "txbox_dlq", "true"), "what did not move is still in the DLQ")
	require.Equal(t, st.Moved, b.count(t, "txbox_outbox", "true"))
	audit := b.audit(t)
	last := audit[len(audit)-1]
	require.Contains(t, last.Result, fmt.Sprintf("stopped by alice after %d of %d letter(s)", st.Moved, n))
	require.Equal(t, auditRow{Operator: "alice", Action: "stop redrive", Target: "redrive #1", Result: "requested"}, audit[len(audit)-2])
}

// Closing the console stops a running redrive between batches and audits its end.
func TestCloseStopsARunningRedrive(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	const n = 40
	for i := range n {
		b.inboxLetter(t, fmt.Sprint("m-", i), "orders", "timeout")
	}
	br := b.browser(t)
	csrf := br.mustSignIn("alice")
	res := br.startRedrive(csrf, url.Values{"topic": {"orders"}, "expect": {fmt.Sprint(n)}, "rate": {"4"}, "batch": {"1"}, "burst": {"1"}})
	var st redriveJSON
	require.Eventually(t, func() bool {
		br.getJSON("/api"+res.header.Get("Location"), &st)
		return st.Moved > 0
	}, 30*time.Second, 10*time.Millisecond)
	b.srv.Close()
	audit := b.audit(t)
	require.Contains(t, audit[len(audit)-1].Result, "stopped by the console stopping after")
	require.Equal(t, n, b.count(t, "txbox_dlq", "true")+b.count(t, "txbox_outbox", "true"))
}
