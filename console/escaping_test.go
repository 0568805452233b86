package console_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
)

// hostile is text a message can carry: markup, quotes that would end an attribute, a terminal
// escape sequence and a bidi override.
const (
	script   = `<script>alert("x")</script>`
	attr     = `"><img src=x onerror=alert(1)>`
	quote    = `'; alert(1); '`
	terminal = "\x1b[31mRED\x1b[0m\a"
	bidi     = "evil\u202etxt.exe"
	hostile  = script + attr + quote + terminal + bidi
)

// formValues are the values of form fields: what the operator typed into a filter, sent back
// exactly as typed (escaped for the attribute) so that the form selects the same again.
var formValues = regexp.MustCompile(` value="[^"]*"`)

// requireInert checks that a page shows hostile text as text: no markup of its own, every
// character visible outside the form fields that keep a filter.
func requireInert(t *testing.T, path string, p page) {
	t.Helper()
	require.Equal(t, 1, strings.Count(p.body, "<script"), "%s: a script element besides the console's own", path)
	require.NotContains(t, p.body, "<img", path)
	require.NotContains(t, p.body, "onerror=alert(1)>", path)
	shown := formValues.ReplaceAllString(p.body, "")
	require.NotContains(t, shown, "\x1b", path)
	require.NotContains(t, shown, "\a", path)
	require.NotContains(t, shown, "\u202e", path)
}

// requireShown checks that a page shows hostile text whole, as text.
func requireShown(t *testing.T, path string, p page) {
	t.Helper()
	require.Contains(t, p.body, `&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;`, path)
	require.Contains(t, p.body, `&#34;&gt;&lt;img src=x onerror=alert(1)&gt;`, path)
	require.Contains(t, p.body, `&#39;; alert(1); &#39;`, path)
	require.Contains(t, p.body, `\x1b[31mRED\x1b[0m\x07`, path)
	require.Contains(t, p.body, `evil\u202etxt.exe`, path)
}

// Nothing a message carries is ever rendered as markup, nor can it rewrite or disguise what the
// page shows: topics, consumers, handlers, reasons, errors, metadata, payloads (text and JSON),
// partition keys, idempotency keys, call results and the audit, on every page that shows them.
func TestNothingFromAMessageIsRenderedAsMarkup(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	meta := map[string]string{hostile: hostile, "plain": hostile}
	note, err := json.Marshal(hostile)
	require.NoError(t, err)
	jsonPayload := fmt.Sprintf(`{"note":%s,"close":"</pre><script>alert(2)</script>"}`, note)
	letter := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: hostile, Consumer: hostile, Handler: hostile,
		DedupKey: hostile, PartitionKey: hostile, UUID: hostile, Payload: []byte(hostile), Metadata: meta, Reason: hostile, Error: hostile})
	jsonLetter := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: hostile, Consumer: hostile, UUID: "m-json",
		Payload: []byte(jsonPayload), Reason: hostile, Error: hostile})
	call := b.addLetter(t, dlq.Entry{Source: dlq.SourceRelay, Kind: "call", Topic: hostile, UUID: "c-1", IdempotencyKey: hostile,
		Payload: []byte(hostile), Reason: hostile, Error: hostile})
	row := b.writeOutbox(t, "orders", []byte(hostile), map[string]string{"note": hostile})
	_, err = b.env.Pool.Exec(ctx, `UPDATE `+b.env.Q("txbox_outbox")+` SET last_error = $2, attempts = 1, topic = $2 WHERE id = $1`, row, hostile)
	require.NoError(t, err)
	_, err = b.env.Pool.Exec(ctx, `INSERT INTO `+b.env.Q("txbox_call_result")+
		` (idempotency_key, call_uuid, outcome, http_status, object_id, body, attempts, duration_ms) VALUES ($1, $1, $1, 200, $1, $1, 1, 1)`, hostile)
	require.NoError(t, err)

	br := b.browser(t)
	csrf := br.mustSignIn("alice")
	q := url.QueryEscape(hostile)
	for _, path := range []string{
		"/letters",
		"/letters?topic=" + q + "&reason=" + q,
		fmt.Sprintf("/letters/%d", letter),
		fmt.Sprintf("/letters/%d", call),
		"/letters/redrive?topic=" + q + "&kind=message",
		"/outbox",
		"/outbox?topic=" + q,
		fmt.Sprintf("/outbox/%d", row),
		"/calls?key=" + q,
		"/calls?object=" + q,
	} {
		res := br.get(path)
		require.Less(t, res.status, 500, path)
		requireInert(t, path, res)
		requireShown(t, path, res)
	}
	// Refused (a call is selected): the page quotes the selection, Go-style.
	refused := br.get("/letters/redrive?topic=" + q)
	require.Equal(t, http.StatusBadRequest, refused.status)
	requireInert(t, "refused redrive", refused)
	require.Contains(t, refused.body, `topic=&#34;&lt;script&gt;alert(\&#34;x\&#34;)&lt;/script&gt;`)

	// JSON payloads are indented as text; what they hold stays text.
	res := br.get(fmt.Sprintf("/letters/%d", jsonLetter))
	requireInert(t, "json letter", res)
	requireShown(t, "json letter", res)
	require.Contains(t, res.body, "shown as JSON")
	require.Contains(t, res.body, `&#34;close&#34;: &#34;&lt;/pre&gt;&lt;script&gt;alert(2)&lt;/script&gt;&#34;`)

	// What an operator types and the audit records is shown the same way.
	seen := br.get("/letters?" + url.Values{"topic": {hostile}, "kind": {"message"}}.Encode())
	form := url.Values{"csrf": {csrf}, "topic": {hostile}, "kind": {"message"}, "expect": {"2"}, "upto": {br.upTo(seen)}}
	require.Equal(t, http.StatusSeeOther, br.post("/letters/discard", form, nil).status)
	audit := br.get("/audit")
	requireInert(t, "/audit", audit)
	require.Contains(t, audit.body, `topic=&#34;&lt;script&gt;alert(\&#34;x\&#34;)&lt;/script&gt;`)
	require.Contains(t, audit.body, "discarded 2 letter(s)")
	require.Equal(t, 1, b.count(t, "txbox_dlq", "true"), "the call letter stays")
}

func TestPayloadsThatAreNotTextAreShownInBase64(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	id := b.addLetter(t, dlq.Entry{Source: dlq.SourceInbox, Topic: "bin", UUID: "m-1", Payload: []byte{0xff, 0xfe, '<', 0x00, 0x1b}, Reason: "x"})
	res := b.browser(t).get(fmt.Sprintf("/letters/%d", id))
	require.Contains(t, res.body, "shown as base64")
	require.Contains(t, res.body, `<pre id="payload">//48ABs=</pre>`)
}
