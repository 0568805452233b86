package console_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	cdppage "github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/dlq"
	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/internal/visible"
	"github.com/txbox/txbox/kafkasub"
	"github.com/txbox/txbox/outbox"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/stripetest"
)

// ArtifactsEnv names a directory for the browser tests' screenshots; without it they go to the
// test's temporary directory, which is removed when the test ends.
const ArtifactsEnv = "TXBOX_TEST_ARTIFACTS"

// chromiumPath finds Debian's chromium. The browser tests fail without it: a skipped browser test
// looks green while proving nothing.
func chromiumPath(t *testing.T) string {
	t.Helper()
	path, err := findChromium("/usr/bin/chromium", exec.LookPath)
	if err != nil {
		t.Fatal(err)
	}
	return path
}

func findChromium(debian string, lookPath func(string) (string, error)) (string, error) {
	if _, err := os.Stat(debian); err == nil {
		return debian, nil
	}
	if path, err := lookPath("chromium"); err == nil {
		return path, nil
	}
	return "", fmt.Errorf("the browser tests need Chromium, and %s is missing: install it with "+
		"`apt-get update && apt-get install -y chromium` (.ci/run does so when it is missing)", debian)
}

func TestWithoutChromiumTheBrowserTestsFailSayingHowToInstallIt(t *testing.T) {
	t.Parallel()
	_, err := findChromium(filepath.Join(t.TempDir(), "chromium"), func(string) (string, error) { return "", exec.ErrNotFound })
	require.ErrorContains(t, err, "apt-get update && apt-get install -y chromium")
}

// newBrowser starts headless Chromium for the test, stopped when the test ends, and returns its
// context and the alerts any page raised (there must be none: an alert is injected script running).
func newBrowser(t *testing.T) (context.Context, func() []string) {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(chromiumPath(t)),
		chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun, chromedp.NoDefaultBrowserCheck,
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.Flag("disable-quic", true), chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-extensions", true), chromedp.Flag("mute-audio", true),
		chromedp.WindowSize(1440, 1000),
	}
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(allocCtx)
	var (
		mu      sync.Mutex
		alerts  []string
		handled = make(chan struct{})
	)
	t.Cleanup(func() {
		cancelCtx()
		cancelAlloc()
		<-handled
	})
	// Subscribed before the first page: the console's confirmations are accepted, as an operator
	// would; any other dialog is injected script running, and is recorded.
	dialogs := chromedp.Events(ctx, cdppage.JavascriptDialogOpening)
	go func() {
		defer close(handled)
		for ev, err := range dialogs {
			if err != nil {
				return
			}
			if ev.Type != cdppage.DialogTypeConfirm {
				mu.Lock()
				alerts = append(alerts, string(ev.Type)+": "+ev.Message)
				mu.Unlock()
			}
			_, _ = chromedp.Call(ctx, cdppage.HandleJavaScriptDialog, cdppage.HandleJavaScriptDialogParams{Accept: ev.Type == cdppage.DialogTypeConfirm})
		}
	}()
	require.NoError(t, chromedp.Do(ctx), "start Chromium")
	return ctx, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), alerts...)
	}
}

// screenshot saves the page as a PNG artefact and logs where.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	dir := os.Getenv(ArtifactsEnv)
	if dir == "" {
		dir = t.TempDir()
	}
	require.NoError(t, os.MkdirAll(dir, 0o755))
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100)) // 100 makes a PNG; less, a JPEG
	require.NoError(t, err)
	path := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(path, png, 0o644))
	t.Logf("screenshot: %s", path)
}

// scenario is a txbox installation at work: a relay publishing to Kafka and calling the Stripe
// test double, and a consumer behind the inbox whose handler rejects messages while the ledger is
// "broken".
type scenario struct {
	env    *txtest.Env
	topic  string
	broken atomic.Bool
	writer *outbox.Writer
}

func startScenario(t *testing.T) *scenario {
	t.Helper()
	ctx := context.Background()
	sc := &scenario{env: txtest.New(t), topic: kafkatest.Topic(t)}
	sc.broken.Store(true)
	var err error
	sc.writer, err = outbox.New(outbox.Config{Schema: sc.env.Schema})
	require.NoError(t, err)
	_, err = sc.env.Pool.Exec(ctx, `CREATE TABLE `+sc.env.Q("ledger")+` (uuid text PRIMARY KEY, payload text NOT NULL)`)
	require.NoError(t, err)

	stripe := stripetest.New(stripetest.Options{})
	t.Cleanup(stripe.Close)
	// The stuck call: Stripe answers 503 to it every time, so the relay retries it for ever.
	stripe.Inject(stripetest.Fault{Kind: stripetest.Fault503, Key: "txbox_stuck", Count: -1})

	sink, err := relay.NewKafkaSink(relay.KafkaConfig{Brokers: kafkatest.Brokers(t)})
	require.NoError(t, err)
	r, err := relay.New(relay.Config{
		DB: sc.env.Pool, Sink: sink, Schema: sc.env.Schema, Shards: 2, LeaseTTL: 3 * time.Second, PollInterval: 10 * time.Millisecond,
		Calls: &relay.CallConfig{
			APIKey: stripetest.TestKey, BaseURL: stripe.URL(),
			HTTPClient: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}},
			MinBackoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, PollInterval: 10 * time.Millisecond,
		},
		Logger: slog.New(slog.DiscardHandler),
	})
	require.NoError(t, err)

	ib, err := inbox.New(inbox.Config{DB: sc.env.Pool, Consumer: "billing", Schema: sc.env.Schema, Delivery: kafkasub.Delivery}, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(ib.Middleware)
	router.AddConsumerHandler("charge", sc.topic, kafkatest.NewSubscriber(t, "billing-"+sc.env.Schema), func(msg *message.Message) error {
		if sc.broken.Load() {
			return fmt.Errorf("%w: the ledger refuses it", inbox.ErrUnprocessable)
		}
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO `+sc.env.Q("ledger")+` (uuid, payload) VALUES ($1, $2)`, msg.UUID, string(msg.Payload))
		return err
	})

	runCtx, cancel := context.WithCancel(ctx)
	relayDone, routerDone := make(chan error, 1), make(chan error, 1)
	go func() { relayDone <- r.Run(runCtx) }()
	go func() { routerDone <- router.Run(runCtx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-routerDone)
		require.NoError(t, <-relayDone)
	})
	<-router.Running()
	return sc
}

func (sc *scenario) publish(t *testing.T, uuid string, payload string, meta map[string]string) {
	t.Helper()
	ctx := context.Background()
	msg := message.NewMessage(uuid, []byte(payload))
	for k, v := range meta {
		msg.Metadata.Set(k, v)
	}
	tx, err := sc.env.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, sc.writer.Publish(ctx, tx, sc.topic, msg))
	require.NoError(t, tx.Commit(ctx))
}

func (sc *scenario) call(t *testing.T, key string) {
	t.Helper()
	ctx := context.Background()
	tx, err := sc.env.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = sc.writer.Call(ctx, tx, outbox.Call{IdempotencyKey: key, Name: "charge", Path: "/v1/charges",
		Params: url.Values{"amount": {"4200"}, "currency": {"eur"}, "source": {"tok_visa"}}})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
}

func (sc *scenario) count(t *testing.T, table, where string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, sc.env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM `+sc.env.Q(table)+` WHERE `+where, args...).Scan(&n))
	return n
}

// text is the text of the first node matching the CSS selector sel.
func text(ctx context.Context, sel string) (string, error) {
	return chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel), chromedp.NodeVisible))
}

// waitText waits until the first node matching sel has text containing want.
func waitText(t *testing.T, ctx context.Context, sel, want string) {
	t.Helper()
	var last string
	require.Eventually(t, func() bool {
		tctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		var err error
		last, err = text(tctx, sel)
		return err == nil && strings.Contains(last, want)
	}, 30*time.Second, 50*time.Millisecond, "%s never showed %q; last: %q", sel, want, last)
}

// An operator's session in a real browser against a real installation: messages dead-lettered by
// a real consumer, a relay publishing to Kafka and calling the Stripe double. The operator opens
// the overview, filters the letters, signs in, redrives one and sees it processed, buries a call
// that never goes through and looks up a call's result.
func TestOperatorScenarioInARealBrowser(t *testing.T) {
	t.Parallel()
	sc := startScenario(t)
	ctx := context.Background()

	// Three payments the consumer's ledger refuses: real dead letters. One carries hostile text.
	hostilePayload := `{"order":"<script>alert('payload')</script>","note":"\u001b[2J"}`
	sc.publish(t, "pay-1", `{"order":1}`, map[string]string{"customer": "c-1"})
	sc.publish(t, "pay-2", `{"order":2}`, map[string]string{"customer": "c-2"})
	sc.publish(t, "pay-evil", hostilePayload, map[string]string{"customer": `"><img src=x onerror=alert('meta')>`})
	require.Eventually(t, func() bool { return sc.count(t, "txbox_dlq", "consumer = 'billing'") == 3 }, time.Minute, 20*time.Millisecond,
		"the consumer dead-letters the three messages")
	sc.broken.Store(false) // The ledger is fixed: a redrive now goes through.

	// One call goes through; one gets 503s for ever.
	sc.call(t, "txbox_paid")
	sc.call(t, "txbox_stuck")
	require.Eventually(t, func() bool {
		return sc.count(t, "txbox_call_result", "idempotency_key = 'txbox_paid'") == 1 &&
			sc.count(t, "txbox_outbox", "idempotency_key = 'txbox_stuck' AND last_error IS NOT NULL") == 1
	}, time.Minute, 20*time.Millisecond)
	var objectID string
	require.NoError(t, sc.env.Pool.QueryRow(ctx, `SELECT object_id FROM `+sc.env.Q("txbox_call_result")+` WHERE idempotency_key = 'txbox_paid'`).
		Scan(&objectID))

	b := setupIn(t, sc.env, nil)
	bctx, alerts := newBrowser(t)
	bctx, cancel := context.WithTimeout(bctx, 3*time.Minute)
	defer cancel()
	base := b.ts.URL

	// The overview.
	require.NoError(t, chromedp.Do(bctx, chromedp.Navigate(base+"/")))
	waitText(t, bctx, "#dlq-inbox-count", "3")
	waitText(t, bctx, "#freshness", "Snapshot as of")
	waitText(t, bctx, "#relays-live", "1")
	waitText(t, bctx, "#calls-retrying", "txbox_stuck")
	waitText(t, bctx, "#leases", "0")
	screenshot(t, bctx, "console-overview.png")

	// Filter the letters: the consumer's, reason "unprocessable".
	require.NoError(t, chromedp.Do(bctx,
		chromedp.Navigate(base+"/letters"),
		chromedp.SetValue(chromedp.CSS(`input[name="consumer"]`), "billing"),
		chromedp.SetValue(chromedp.CSS(`input[name="reason"]`), "unprocessable"),
		chromedp.Click(chromedp.CSS("#apply-filter")),
		chromedp.WaitVisible(chromedp.CSS("#letters")),
	))
	waitText(t, bctx, "#letter-count", "3 letter(s)")
	rows, err := chromedp.Run(bctx, chromedp.Evaluate[int](`document.querySelectorAll("#letters tbody tr").length`))
	require.NoError(t, err)
	require.Equal(t, 3, rows)
	screenshot(t, bctx, "console-letters.png")

	// The hostile letter shows its payload and metadata as text.
	var evilID int64
	require.NoError(t, sc.env.Pool.QueryRow(ctx, `SELECT id FROM `+sc.env.Q("txbox_dlq")+` WHERE uuid = 'pay-evil'`).Scan(&evilID))
	require.NoError(t, chromedp.Do(bctx, chromedp.Navigate(fmt.Sprintf("%s/letters/%d", base, evilID))))
	payload, err := text(bctx, "#payload")
	require.NoError(t, err)
	require.Contains(t, payload, `"order": "<script>alert('payload')</script>"`)
	meta, err := text(bctx, "#metadata")
	require.NoError(t, err)
	require.Contains(t, meta, `"><img src=x onerror=alert('meta')>`)
	images, err := chromedp.Run(bctx, chromedp.Evaluate[int](`document.images.length`))
	require.NoError(t, err)
	require.Zero(t, images)
	screenshot(t, bctx, "console-letter.png")

	// Sign in, from the letter of pay-1, and redrive it.
	var payID int64
	require.NoError(t, sc.env.Pool.QueryRow(ctx, `SELECT id FROM `+sc.env.Q("txbox_dlq")+` WHERE uuid = 'pay-1'`).Scan(&payID))
	require.NoError(t, chromedp.Do(bctx,
		chromedp.Navigate(fmt.Sprintf("%s/letters/%d", base, payID)),
		chromedp.Click(chromedp.CSS("#sign-in")),
		chromedp.WaitVisible(chromedp.CSS("#sign-in-form")),
		chromedp.SendKeys(chromedp.CSS("#operator-name"), "alice"),
		chromedp.SendKeys(chromedp.CSS("#token"), testToken),
		chromedp.Click(chromedp.CSS("#sign-in-submit")),
	))
	waitText(t, bctx, "#operator", "alice")
	waitText(t, bctx, "#letter-reason", "unprocessable")
	require.NoError(t, chromedp.Do(bctx,
		chromedp.Click(chromedp.CSS("#redrive-one")),
		chromedp.WaitVisible(chromedp.CSS("#redrive-form")),
	))
	waitText(t, bctx, "#planned", "1")
	require.NoError(t, chromedp.Do(bctx, chromedp.Click(chromedp.CSS("#redrive-submit"))))
	waitText(t, bctx, "#redrive-state", "done")
	waitText(t, bctx, "#redrive-moved", "1")

	// Processed: the consumer's effect is there, the letter is gone.
	require.Eventually(t, func() bool { return sc.count(t, "ledger", "uuid = 'pay-1'") == 1 }, time.Minute, 20*time.Millisecond,
		"the redriven message reaches the consumer through the relay and Kafka")
	require.Zero(t, sc.count(t, "txbox_dlq", "uuid = 'pay-1'"))

	// The other two, paced: one letter every 5 s. The page follows the redrive as it runs.
	require.NoError(t, chromedp.Do(bctx, chromedp.Navigate(base+"/letters?consumer=billing")))
	waitText(t, bctx, "#letter-count", "2 letter(s)")
	require.NoError(t, chromedp.Do(bctx,
		chromedp.Click(chromedp.CSS("#redrive-link")),
		chromedp.WaitVisible(chromedp.CSS("#redrive-form")),
	))
	waitText(t, bctx, "#planned", "2")
	require.NoError(t, chromedp.Do(bctx,
		chromedp.SendKeys(chromedp.CSS("#rate"), "0.2"),
		chromedp.SendKeys(chromedp.CSS("#burst"), "1"),
		chromedp.SendKeys(chromedp.CSS("#batch"), "1"),
		chromedp.Click(chromedp.CSS("#redrive-submit")),
	))
	waitText(t, bctx, "#redrive-state", "running")
	waitText(t, bctx, "#redrive-moved", "1")
	screenshot(t, bctx, "console-redrive-running.png")
	// No reload: the page's script polls the redrive's JSON.
	waitText(t, bctx, "#redrive-state", "done")
	waitText(t, bctx, "#redrive-moved", "2")
	require.Eventually(t, func() bool { return sc.count(t, "ledger", "uuid IN ('pay-2', 'pay-evil')") == 2 }, time.Minute, 20*time.Millisecond)
	require.Zero(t, sc.count(t, "txbox_dlq", "consumer = 'billing'"))

	// Bury the call that never goes through.
	require.NoError(t, chromedp.Do(bctx,
		chromedp.Navigate(base+"/outbox?kind=call&failing=on"),
		chromedp.WaitVisible(chromedp.CSS("#rows")),
		chromedp.Click(chromedp.CSS("#rows tbody tr a")),
		chromedp.WaitVisible(chromedp.CSS("#bury-form")),
		chromedp.SendKeys(chromedp.CSS("#bury-reason"), "Stripe keeps failing; reconciling by hand (OPS-7)"),
		chromedp.Click(chromedp.CSS("#bury-submit")),
	))
	waitText(t, bctx, "#flash", "Done: outbox row")
	require.Equal(t, 1, sc.count(t, "txbox_dlq", "idempotency_key = 'txbox_stuck' AND kind = 'call' AND reason = 'buried by operator'"))
	require.Zero(t, sc.count(t, "txbox_outbox", "idempotency_key = 'txbox_stuck'"))

	// Look the paid call up, by key and by the charge id Stripe shows.
	require.NoError(t, chromedp.Do(bctx,
		chromedp.Navigate(base+"/calls"),
		chromedp.SendKeys(chromedp.CSS("#call-key"), "txbox_paid"),
		chromedp.Click(chromedp.CSS("#call-submit")),
	))
	waitText(t, bctx, ".result-outcome", "succeeded")
	waitText(t, bctx, ".result-object", objectID)
	require.NoError(t, chromedp.Do(bctx,
		chromedp.Navigate(base+"/calls?object="+url.QueryEscape(objectID)),
	))
	waitText(t, bctx, ".result-key", "txbox_paid")

	// The overview: no inbox letter left, the buried call among the relay's letters.
	require.NoError(t, chromedp.Do(bctx, chromedp.Navigate(base+"/")))
	waitText(t, bctx, "#dlq-inbox-count", "0")
	waitText(t, bctx, "#dlq-relay-count", "1")
	waitText(t, bctx, "#calls-retrying", "none")
	// It follows what happens without a reload: the ledger breaks again and a payment dies.
	sc.broken.Store(true)
	sc.publish(t, "pay-late", `{"order":4}`, nil)
	waitText(t, bctx, "#dlq-inbox-count", "1")
	screenshot(t, bctx, "console-overview-after.png")

	audit := b.audit(t)
	var actions []string
	for _, a := range audit {
		require.Equal(t, "alice", a.Operator)
		actions = append(actions, a.Action+": "+a.Result)
	}
	require.Len(t, actions, 6, "%q", actions)
	require.Equal(t, "sign in: ok", actions[0])
	require.Equal(t, "redrive: started", actions[1])
	require.True(t, strings.HasPrefix(actions[2], "redrive: moved 1 of 1 letter(s)"), actions[2])
	require.Equal(t, "redrive: started", actions[3])
	require.True(t, strings.HasPrefix(actions[4], "redrive: moved 2 of 2 letter(s), released 2"), actions[4])
	require.True(t, strings.HasPrefix(actions[5], "bury: moved call"), actions[5])
	require.Empty(t, alerts(), "script from a message ran")
	require.False(t, errors.Is(bctx.Err(), context.DeadlineExceeded))
}

// The overview is the one page a script fills in: it too shows stored text as text, in a real
// browser, escapes included.
func TestOverviewShowsStoredTextAsText(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := b.env.Pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	exec(`INSERT INTO `+b.env.Q("txbox_lease")+` (shard, shards, owner, token, expires_at) VALUES (0, 1, $1, 7, now() + interval '1 minute')`, hostile)
	exec(`INSERT INTO `+b.env.Q("txbox_relay_node")+` (owner, expires_at) VALUES ($1, now() + interval '1 minute')`, hostile)
	exec(`INSERT INTO `+b.env.Q("txbox_dedup_stats")+` (minute, consumer, handler, checks, hits) VALUES (date_trunc('minute', now()), $1, $1, 4, 1)`, hostile)
	exec(`INSERT INTO `+b.env.Q("txbox_call_result")+` (idempotency_key, call_uuid, outcome, http_status, object_id, body, attempts, duration_ms)
		VALUES ($1, 'c', 'declined', 402, $1, '', 1, 1)`, hostile)
	b.addLetter(t, dlq.Entry{Source: dlq.SourceRelay, Kind: "call", Topic: "t", UUID: "c-1", IdempotencyKey: hostile, Reason: hostile, Error: hostile})

	bctx, alerts := newBrowser(t)
	bctx, cancel := context.WithTimeout(bctx, 2*time.Minute)
	defer cancel()
	require.NoError(t, chromedp.Do(bctx, chromedp.Navigate(b.ts.URL+"/")))
	waitText(t, bctx, "#freshness", "Snapshot as of")
	// The script escapes as the server does (internal/visible).
	shown := visible.Escape(hostile, false)
	require.Equal(t, `<script>alert("x")</script>"><img src=x onerror=alert(1)>'; alert(1); '\x1b[31mRED\x1b[0m\x07evil\u202etxt.exe`, shown)
	for _, table := range []string{"#leases", "#relays", "#dedup", "#calls-unsuccessful", "#calls-dead"} {
		waitText(t, bctx, table, shown)
	}
	waitText(t, bctx, "#dedup", "25.00 %")
	images, err := chromedp.Run(bctx, chromedp.Evaluate[int](`document.images.length`))
	require.NoError(t, err)
	require.Zero(t, images)
	scripts, err := chromedp.Run(bctx, chromedp.Evaluate[int](`document.scripts.length`))
	require.NoError(t, err)
	require.Equal(t, 1, scripts)
	href, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.querySelector("#calls-dead tbody tr td:nth-child(2) a").getAttribute("href")`))
	require.NoError(t, err)
	u, err := url.Parse(href)
	require.NoError(t, err)
	require.Equal(t, "/calls", u.Path, "a link stays on the console")
	require.Empty(t, u.Host)
	require.Equal(t, hostile, u.Query().Get("key"), "and carries the key exactly")
	screenshot(t, bctx, "console-overview-hostile.png")
	require.Empty(t, alerts(), "script from the database ran")
}
