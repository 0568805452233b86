package dlq

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/outbox"
)

// DefaultRedriveBatchSize is RedriveOptions.BatchSize when it is not specified.
const DefaultRedriveBatchSize = 100

// MaxUnpacedRedrive is the most letters PaceFor lets a redrive move without a rate a person chose:
// a redrive is new traffic for every consumer of the topics and for the APIs they call.
const MaxUnpacedRedrive = 100

// ErrRateRequired is returned by PaceFor when more than MaxUnpacedRedrive letters are selected and
// no rate was given.
var ErrRateRequired = fmt.Errorf("dlq: a redrive of more than %d letters needs a rate", MaxUnpacedRedrive)

// RedriveOptions configures a redrive.
type RedriveOptions struct {
	// Rate is the most letters moved per second. Required: a redrive is new traffic for every
	// consumer of the topics and for the APIs they call, and an unpaced "redrive all" is how a DLQ
	// floods them. Set rate.Inf to move without a limit.
	Rate rate.Limit
	// Burst is how many letters may move at once before the rate applies; it is also the largest
	// batch. If not specified, defaults to a tenth of a second's worth of Rate, at least 1 and at
	// most BatchSize, so that consumers see a steady stream rather than a batch a second.
	Burst int
	// BatchSize is the most letters moved per transaction. If not specified, defaults to
	// DefaultRedriveBatchSize; it is lowered to Burst when that is smaller.
	BatchSize int
	// DryRun plans the redrive, refusing what Redrive would refuse, and moves nothing.
	DryRun bool
	// Progress, when set, is called after each batch commits.
	Progress func(RedriveProgress)
}

// Resolved returns o with its defaults filled in, as Redrive uses it, or an error naming the
// setting it cannot use.
func (o RedriveOptions) Resolved() (RedriveOptions, error) {
	if math.IsNaN(float64(o.Rate)) || o.Rate <= 0 {
		return o, fmt.Errorf("dlq: RedriveOptions.Rate is required and must be positive, got %v; use rate.Inf for no limit", float64(o.Rate))
	}
	if o.BatchSize < 0 || o.Burst < 0 {
		return o, fmt.Errorf("dlq: RedriveOptions.BatchSize and Burst must not be negative, got %d and %d", o.BatchSize, o.Burst)
	}
	if o.BatchSize == 0 {
		o.BatchSize = DefaultRedriveBatchSize
	}
	if o.Burst == 0 {
		o.Burst = o.BatchSize
		if tenth := float64(o.Rate) / 10; tenth < float64(o.Burst) {
			o.Burst = max(1, int(tenth))
		}
	}
	// WaitN refuses more than Burst tokens at once.
	o.BatchSize = min(o.BatchSize, o.Burst)
	return o, nil
}

// RedriveProgress is the state of a running redrive.
type RedriveProgress struct {
	// Moved is how many letters have been moved so far.
	Moved int
	// Total is how many letters the filter selected when the redrive started.
	Total int
	// Elapsed is the time since the first batch started.
	Elapsed time.Duration
}

// TopicCount is how many selected letters go to one topic.
type TopicCount struct {
	Topic   string
	Kind    string
	Letters int
}

// RedriveResult reports what a redrive did, or would do when it was a dry run.
type RedriveResult struct {
	// Planned is how many letters the filter selected when the redrive started.
	Planned int
	// Topics breaks Planned down by topic and kind, in the order of their lowest letter ids.
	Topics []TopicCount
	// Moved is how many letters were written back into the outbox and deleted from the DLQ.
	Moved int
	// Released is how many 'dead' inbox rows were deleted so that their consumers process the
	// redriven messages.
	Released int
	// Elapsed is how long the moving took.
	Elapsed time.Duration
}

// DB is what Redrive needs: it plans with one query and moves letters in transactions.
// *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type DB interface {
	TxBeginner
	Queryer
}

// Redrive writes the messages of the letters f selects back into the outbox and deletes the
// letters, so the relay publishes them again to their topics, with their UUIDs, payloads,
// metadata and partition keys.
//
// Each batch is one transaction: it locks its letters (skipping letters another redrive holds, so
// no letter moves twice; those still there at the end, because that redrive rolled back, are
// moved in one more pass from the start), writes them with outbox.Writer.Publish, deletes the 'dead' inbox rows of
// inbox letters so their consumers process the messages again, and deletes the letters. A
// consumer that processed a message (an inbox row in state 'done') keeps that row and skips the
// redriven copy. Cancelling ctx stops between batches, or rolls the current batch back; nothing
// moves half-way, and running Redrive again continues.
//
// The selection is fixed when Redrive starts: letters added later, including messages that fail
// again on their way back, wait for the next run. Letters are moved in id order; two redrives
// running at once share the work but do not keep each other's order.
//
// The redriven copy of an inbox letter reaches every consumer of its topic again, for as long as
// the broker keeps it. Redrive records the message's UUID and topic with the time, in the same
// transaction, and retention keeps every consumer's inbox rows of the message for its
// InboxRetention from then (see package retention).
//
// Side-effect calls (ErrCallNotRedrivable), messages without an id (ErrNoMessageID) or a topic
// (ErrNoTopic), and payloads over the outbox's limit (ErrTooLarge) are refused before anything
// moves. An empty filter is
// refused unless Filter.All is set (ErrEmptyFilter).
func (a *Admin) Redrive(ctx context.Context, db DB, f Filter, opts RedriveOptions) (RedriveResult, error) {
	if err := f.validate(); err != nil {
		return RedriveResult{}, err
	}
	if f.IsEmpty() && !f.All {
		return RedriveResult{}, ErrEmptyFilter
	}
	opts, err := opts.Resolved()
	if err != nil {
		return RedriveResult{}, err
	}

	res, w, err := a.plan(ctx, db, f)
	if err != nil || opts.DryRun || res.Planned == 0 {
		return res, err
	}

	limiter := rate.NewLimiter(opts.Rate, opts.Burst)
	origin, began := w.after, time.Now()
	for res.Moved < res.Planned {
		n := min(opts.BatchSize, res.Planned-res.Moved)
		if err := limiter.WaitN(ctx, n); err != nil {
			res.Elapsed = time.Since(began)
			return res, fmt.Errorf("dlq: redrive stopped after %d of %d letters: %w", res.Moved, res.Planned, contextErr(ctx, err))
		}
		w.limit = n
		moved, released, last, err := a.moveBatch(ctx, db, f, w)
		res.Elapsed = time.Since(began)
		if err != nil {
			return res, fmt.Errorf("dlq: redrive stopped after %d of %d letters: %w", res.Moved, res.Planned, err)
		}
		res.Moved += moved
		res.Released += released
		if opts.Progress != nil && moved > 0 {
			opts.Progress(RedriveProgress{Moved: res.Moved, Total: res.Planned, Elapsed: res.Elapsed})
		}
		if moved < n {
			if *w.after == *origin {
				break // The rest went to another redrive, or was discarded meanwhile.
			}
			// Letters another redrive held as this one passed them lie behind the cursor; if that
			// redrive rolled back they are still here. One pass from the start picks them up.
			w.after = origin
			continue
		}
		w.after = &last
	}
	return res, nil
}

// PaceFor completes opts for redriving the letters that plan, a dry run of f, counted: the rule
// that `txbox dlq redrive` and the console share. With a Rate set it changes nothing. Without one
// it allows at most MaxUnpacedRedrive letters, moved without a limit, and narrows f to the letters
// counted, so that letters arriving meanwhile wait for a paced run; more letters are refused with
// ErrRateRequired.
func PaceFor(f Filter, plan RedriveResult, opts RedriveOptions) (Filter, RedriveOptions, error) {
	if opts.Rate != 0 {
		return f, opts, nil
	}
	if plan.Planned > MaxUnpacedRedrive {
		return f, opts, fmt.Errorf("%w: %d are selected", ErrRateRequired, plan.Planned)
	}
	opts.Rate = rate.Inf
	if f.Limit == 0 || f.Limit > plan.Planned {
		f.Limit = plan.Planned
	}
	return f, opts, nil
}

// contextErr prefers ctx's own error: the limiter reports a cancellation in its own words, and
// refuses a wait that would outlast ctx's deadline while the deadline is still ahead, when ctx.Err
// is nil. A caller branching on context.DeadlineExceeded must see it either way.
func contextErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if _, ok := ctx.Deadline(); ok {
		return fmt.Errorf("%w: %v", context.DeadlineExceeded, err)
	}
	return err
}

// plan counts the selection per topic, refuses what cannot go back to the outbox (calls, messages
// without an id or a topic, payloads the outbox would refuse), and fixes the selection's bounds.
func (a *Admin) plan(ctx context.Context, db Queryer, f Filter) (RedriveResult, window, error) {
	var (
		res     RedriveResult
		refused = [...]struct {
			err     error
			letters int
			first   []int64 // The first few ids of each group of them.
		}{{err: ErrCallNotRedrivable}, {err: ErrNoMessageID}, {err: ErrNoTopic}, {err: ErrTooLarge}}
		maxID int64
		asOf  time.Time
	)
	rows, err := db.Query(ctx, a.sql.plan, append(f.args(window{limit: f.Limit}), a.outbox.MaxPayloadBytes(), outbox.MaxUUIDBytes)...)
	if err != nil {
		return res, window{}, fmt.Errorf("dlq: plan redrive: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			tc             TopicCount
			noID, tooLarge bool
			first          []int64
			top            int64
		)
		if err := rows.Scan(&tc.Topic, &tc.Kind, &noID, &tooLarge, &tc.Letters, &first, &top, &asOf); err != nil {
			return res, window{}, fmt.Errorf("dlq: plan redrive: %w", err)
		}
		res.Topics = append(res.Topics, tc)
		res.Planned += tc.Letters
		maxID = max(maxID, top)
		var why error
		switch {
		case tc.Kind == "call":
			why = ErrCallNotRedrivable
		case noID:
			why = ErrNoMessageID
		case tc.Topic == "":
			why = ErrNoTopic
		case tooLarge:
			why = ErrTooLarge
		}
		for i := range refused {
			if why != nil && refused[i].err == why {
				refused[i].letters += tc.Letters
				refused[i].first = append(refused[i].first, first...)
			}
		}
	}
	if err := rows.Err(); err != nil {
		return res, window{}, fmt.Errorf("dlq: plan redrive: %w", err)
	}
	for _, r := range refused {
		if r.letters > 0 {
			slices.Sort(r.first)
			return res, window{}, fmt.Errorf("%w: the filter selects %d such letter(s), ids %s", r.err, r.letters, idList(r.first, r.letters))
		}
	}
	var from int64 // Identity ids start at 1.
	return res, window{asOf: &asOf, after: &from, atMost: &maxID}, nil
}

// moveBatch moves up to w.limit letters in one transaction and returns how many it moved, how many
// inbox rows it released, and the highest id it moved.
func (a *Admin) moveBatch(ctx context.Context, db TxBeginner, f Filter, w window) (moved, released int, last int64, err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // A no-op after Commit.

	rows, err := tx.Query(ctx, a.sql.lockBatch, f.args(w)...)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("lock letters: %w", err)
	}
	letters, err := collectLetters(rows)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("lock letters: %w", err)
	}
	if len(letters) == 0 {
		return 0, 0, 0, nil
	}

	var (
		ids                            = make([]int64, len(letters))
		consumers, handlers, dedupKeys []string
		uuids, uuidTopics              []string
		byTopic                        = map[string][]*message.Message{}
		topics                         []string
		idsByTopic                     = map[string][]int64{}
	)
	for i, l := range letters {
		if l.Kind == "call" {
			// Added after the plan was made: refuse it as the plan would have.
			return 0, 0, 0, fmt.Errorf("%w: letter %d", ErrCallNotRedrivable, l.ID)
		}
		ids[i] = l.ID
		if l.Source == SourceInbox && l.Consumer != "" {
			consumers = append(consumers, l.Consumer)
			handlers = append(handlers, l.Handler)
			dedupKeys = append(dedupKeys, l.DedupKey)
		}
		// Relay letters too: a message buried as it was published may have reached consumers,
		// whose 'done' rows must outlive the redriven copy as well.
		uuids = append(uuids, l.UUID)
		uuidTopics = append(uuidTopics, l.Topic)
		msg := message.NewMessage(l.UUID, l.Payload)
		for k, v := range l.Metadata {
			msg.Metadata.Set(k, v)
		}
		// A subscriber other than watermill-kafka's may hand the inbox the UUID as metadata too;
		// the outbox refuses the key (its marshaler writes the UUID under it), and the letter's
		// UUID is the message's. Left in, the letter failed its batch and held the rest back.
		delete(msg.Metadata, outbox.ReservedMetadata)
		if l.PartitionKey != "" {
			outbox.SetPartitionKey(msg, l.PartitionKey)
		}
		if _, ok := byTopic[l.Topic]; !ok {
			topics = append(topics, l.Topic)
		}
		byTopic[l.Topic] = append(byTopic[l.Topic], msg)
		idsByTopic[l.Topic] = append(idsByTopic[l.Topic], l.ID)
	}
	// Per topic, in id order: the outbox gives one call's messages ascending ids, so messages of a
	// key leave in the order they came in. Across topics there is no order to keep.
	for _, topic := range topics {
		if err := a.outbox.Publish(ctx, tx, topic, byTopic[topic]...); err != nil {
			if errors.Is(err, outbox.ErrInvalidMessage) {
				return 0, 0, 0, fmt.Errorf("letters %s cannot go back to the outbox (discard the bad one): %w", idList(idsByTopic[topic], len(idsByTopic[topic])), err)
			}
			return 0, 0, 0, err
		}
	}
	if len(consumers) > 0 {
		tag, err := tx.Exec(ctx, a.sql.releaseDead, consumers, handlers, dedupKeys)
		if err != nil {
			return 0, 0, 0, fmt.Errorf("release inbox rows: %w", err)
		}
		released = int(tag.RowsAffected())
	}
	if _, err := tx.Exec(ctx, a.sql.recordRedrive, uuids, uuidTopics); err != nil {
		return 0, 0, 0, fmt.Errorf("record the redrive: %w", err)
	}
	if _, err := tx.Exec(ctx, a.sql.deleteLetters, ids); err != nil {
		return 0, 0, 0, fmt.Errorf("delete letters: %w", err)
	}
	// A commit cut off by an interrupt may still take effect on the server, and the redrive would
	// then report fewer letters moved than it moved: it waits for the answer instead, for a while.
	commitCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitWait)
	defer cancel()
	if err := tx.Commit(commitCtx); err != nil {
		return 0, 0, 0, fmt.Errorf("commit: %w", err)
	}
	return len(letters), released, ids[len(ids)-1], nil
}

// commitWait bounds how long an interrupted redrive waits for its last batch's commit.
const commitWait = 30 * time.Second

// idList formats the first ids of total, for messages.
func idList(ids []int64, total int) string {
	const show = 10
	s := ""
	for i, id := range ids {
		if i == show {
			break
		}
		if i > 0 {
			s += ", "
		}
		s += fmt.Sprint(id)
	}
	if total > min(len(ids), show) {
		s += ", …"
	}
	return s
}

var _ DB = pgx.Tx(nil)
