package console_test

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/outbox"
)

// A discard and its audit row commit together: when the audit cannot be written, the letters stay.
func TestADiscardThatCannotBeAuditedDoesNotHappen(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	id := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: "m-1", Reason: "boom"})
	br := b.browser(t)
	csrf := br.mustSignIn("alice")
	_, err := b.env.Pool.Exec(ctx, `ALTER TABLE `+b.env.Q("txbox_console_audit")+` ADD CONSTRAINT no_discards CHECK (action <> 'discard')`)
	require.NoError(t, err)

	res := br.post("/letters/discard", url.Values{"csrf": {csrf}, "id": {strconv.FormatInt(id, 10)}, "expect": {"1"}}, nil)
	require.Equal(t, http.StatusSeeOther, res.status)
	require.Contains(t, br.get("/letters").body, "Nothing was discarded: console: audit:")
	require.Equal(t, 1, b.count(t, "txbox_dlq", "true"), "the discard rolled back with its audit row")
	require.Contains(t, b.logs.String(), "the audit row could not be written")
}

// A discard by filter deletes only letters the operator saw: those of the page, bounded by the
// highest letter id when it was made. One removed meanwhile refuses the discard, though a letter
// added since keeps the count the same: before, the count alone was checked, and the new letter,
// never seen, was discarded in the place of the one redriven.
func TestDiscardDeletesOnlyTheLettersTheOperatorSaw(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	var first int64
	for i := range 3 {
		id := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: fmt.Sprint("m-", i), Reason: "timeout"})
		first = cmp.Or(first, id)
	}
	br := b.browser(t)
	csrf := br.mustSignIn("alice")
	list := br.get("/letters?consumer=billing")
	require.Contains(t, list.body, "3 letter(s)")
	require.Contains(t, list.body, `name="expect" value="3"`)
	// While the operator looks, a colleague removes one letter and a new one arrives.
	admin, err := dlq.NewAdmin(dlq.AdminConfig{Schema: b.env.Schema})
	require.NoError(t, err)
	_, err = admin.Discard(ctx, b.env.Pool, dlq.Filter{IDs: []int64{first}})
	require.NoError(t, err)
	b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: "m-late", Reason: "timeout"})
	form := url.Values{"csrf": {csrf}, "consumer": {"billing"}, "expect": {"3"}, "upto": {br.upTo(list)}}
	require.Equal(t, http.StatusSeeOther, br.post("/letters/discard", form, nil).status)
	require.Contains(t, br.get("/letters").body, "the selection holds 2 letter(s) now, not the 3 you saw; nothing was changed")
	require.Equal(t, 3, b.count(t, "txbox_dlq", "true"))

	// A form that does not bound the selection, or an empty filter, never discards.
	form.Del("upto")
	require.Equal(t, http.StatusSeeOther, br.post("/letters/discard", form, nil).status)
	require.Contains(t, br.get("/letters").body, "the form does not say which letters you saw")
	require.Equal(t, http.StatusSeeOther, br.post("/letters/discard", url.Values{"csrf": {csrf}, "expect": {"3"}, "upto": {br.upTo(list)}}, nil).status)
	require.Contains(t, br.get("/letters").body, "choose a filter first")
	require.Equal(t, 3, b.count(t, "txbox_dlq", "true"))

	// Looking again shows the three; one more that fails after that is not discarded with them.
	list = br.get("/letters?consumer=billing")
	require.Contains(t, list.body, "m-late")
	b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "orders", Consumer: "billing", UUID: "m-later", Reason: "timeout"})
	form.Set("upto", br.upTo(list))
	require.Equal(t, http.StatusSeeOther, br.post("/letters/discard", form, nil).status)
	require.Equal(t, 1, b.count(t, "txbox_dlq", "uuid = 'm-later'"), "the letter that failed after the page stays")
	require.Equal(t, 1, b.count(t, "txbox_dlq", "true"))
	audit := b.audit(t)
	require.Equal(t, auditRow{Operator: "alice", Action: "discard", Target: `letters: consumer="billing"`,
		Detail: "3 letter(s) seen, ids up to " + br.upTo(list), Result: "discarded 3 letter(s)"}, audit[len(audit)-1])
	require.Contains(t, audit[len(audit)-2].Result, "failed: the selection holds 2 letter(s) now", "the refused attempt is audited too")
}

// writeOutbox writes one message into the outbox as a producer would.
func (b *bundle) writeOutbox(t *testing.T, topic string, payload []byte, meta map[string]string) int64 {
	t.Helper()
	ctx := context.Background()
	w, err := outbox.New(outbox.Config{Schema: b.env.Schema})
	require.NoError(t, err)
	msg := message.NewMessage(fmt.Sprint("msg-", time.Now().UnixNano()), payload)
	for k, v := range meta {
		msg.Metadata.Set(k, v)
	}
	tx, err := b.env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, w.Publish(ctx, tx, topic, msg))
	require.NoError(t, tx.Commit(ctx))
	var id int64
	require.NoError(t, b.env.Pool.QueryRow(ctx, `SELECT id FROM `+b.env.Q("txbox_outbox")+` WHERE uuid = $1`, msg.UUID).Scan(&id))
	return id
}

func TestBuryMovesTheRowToTheDLQAndAuditsIt(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	id := b.writeOutbox(t, "retired.topic", []byte(`{"n":1}`), nil)
	br := b.browser(t)
	csrf := br.mustSignIn("alice")
	path := fmt.Sprintf("/outbox/%d", id)
	page := br.get(path)
	require.Contains(t, page.body, `id="bury-form"`)
	require.Contains(t, br.get("/outbox").body, fmt.Sprintf(`href="/outbox/%d"`, id))

	// The bury and its audit row commit together.
	_, err := b.env.Pool.Exec(context.Background(), `ALTER TABLE `+b.env.Q("txbox_console_audit")+` ADD CONSTRAINT no_burials CHECK (action <> 'bury')`)
	require.NoError(t, err)
	require.Equal(t, http.StatusSeeOther, br.post(path+"/bury", url.Values{"csrf": {csrf}, "reason": {"retired"}}, nil).status)
	require.Contains(t, br.get(path).body, "Nothing was buried: console: audit:")
	require.Equal(t, 1, b.count(t, "txbox_outbox", "true"))
	require.Zero(t, b.count(t, "txbox_dlq", "true"))
	_, err = b.env.Pool.Exec(context.Background(), `ALTER TABLE `+b.env.Q("txbox_console_audit")+` DROP CONSTRAINT no_burials`)
	require.NoError(t, err)

	res := br.post(path+"/bury", url.Values{"csrf": {csrf}, "reason": {"  "}}, nil)
	require.Equal(t, http.StatusSeeOther, res.status)
	require.Contains(t, br.get(path).body, "Nothing was buried: give a reason")
	require.Equal(t, 1, b.count(t, "txbox_outbox", "true"))

	res = br.post(path+"/bury", url.Values{"csrf": {csrf}, "reason": {"topic retired, see OPS-12"}}, nil)
	require.Equal(t, http.StatusSeeOther, res.status)
	require.Equal(t, "/outbox", res.header.Get("Location"))
	require.Contains(t, br.get("/outbox").body, fmt.Sprintf("Done: outbox row %d moved message", id))
	require.Zero(t, b.count(t, "txbox_outbox", "true"))
	require.Equal(t, 1, b.count(t, "txbox_dlq", "source = 'relay' AND reason = 'buried by operator' AND topic = 'retired.topic' "+
		"AND error = 'by alice in the console: topic retired, see OPS-12'"))
	audit := b.audit(t)
	last := audit[len(audit)-1]
	require.Equal(t, "bury", last.Action)
	require.Equal(t, fmt.Sprintf("outbox row %d", id), last.Target)
	require.Equal(t, "topic retired, see OPS-12", last.Detail)
	require.Contains(t, last.Result, `to the DLQ`)

	// Gone is gone: a second bury finds nothing, and says so.
	require.Equal(t, http.StatusSeeOther, br.post(path+"/bury", url.Values{"csrf": {csrf}, "reason": {"again"}}, nil).status)
	require.Contains(t, br.get("/outbox").body, "Nothing was buried: relay: no such pending outbox row")
	require.Equal(t, http.StatusNotFound, br.get(path).status)
}

func TestCallResultLookup(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.env.Pool.Exec(context.Background(), `INSERT INTO `+b.env.Q("txbox_call_result")+
		` (idempotency_key, call_uuid, outcome, http_status, object_id, body, attempts, duration_ms, first_attempt_at)
		VALUES ('txbox_key1', 'call-1', 'succeeded', 200, 'ch_123', '{"id":"ch_123","amount":4200}', 2, 87, now() - interval '1 minute'),
		       ('txbox_key2', 'call-2', 'declined', 402, 'ch_456', '{"error":{"code":"card_declined"}}', 1, 40, now())`)
	require.NoError(t, err)
	br := b.browser(t)
	require.NotContains(t, br.get("/calls").body, "call-result")

	byKey := br.get("/calls?key=txbox_key1").body
	require.Equal(t, 1, strings.Count(byKey, `class="call-result"`))
	require.Contains(t, byKey, `<dd class="result-outcome">succeeded</dd>`)
	require.Contains(t, byKey, `<dd class="mono result-object">ch_123</dd>`)
	require.Contains(t, byKey, "&#34;amount&#34;: 4200", "the body is shown as indented JSON text")

	byObject := br.get("/calls?object=ch_456").body
	require.Contains(t, byObject, `<dd class="result-outcome">declined</dd>`)
	require.Contains(t, byObject, "txbox_key2")
	require.Contains(t, br.get("/calls?object=ch_nothing").body, `id="no-result"`)
}
