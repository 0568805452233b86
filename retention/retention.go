package retention

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txbox/txbox/internal/sqlname"
)

// Defaults of Config.
const (
	DefaultInboxRetention      = 15 * 24 * time.Hour
	DefaultCallResultRetention = 30 * 24 * time.Hour
	// MinCallResultRetention is Stripe's idempotency key lifetime: a call result must outlive it.
	MinCallResultRetention = 24 * time.Hour
	DefaultBatchSize       = 1000
	DefaultInterval        = time.Hour
	// MinInterval is the shortest Config.Interval: a pass is several queries, not a poll.
	MinInterval            = time.Second
	DefaultInboxGeneration = 24 * time.Hour
	// DefaultGenerationLockTimeout is below inbox.DefaultLockTimeout: a delivery that waits behind a
	// rotation waits less than it is prepared to wait for a lock.
	DefaultGenerationLockTimeout = time.Second
)

// tables are the tables whose sizes are reported, in this order.
var tables = []string{"txbox_outbox", "txbox_inbox", "txbox_inbox_attempt", "txbox_dlq", "txbox_redrive", "txbox_call_result"}

// DB is what the Cleaner needs from PostgreSQL; *pgxpool.Pool satisfies it. Each batch is one
// statement, so a pool (not a transaction) is what keeps the locks short; a rotation is one
// transaction.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Config configures a Cleaner.
type Config struct {
	// DB holds txbox's tables. Required.
	DB DB
	// Schema is the PostgreSQL schema holding txbox's tables. If not specified, defaults to "public".
	Schema string
	// BrokerRetention is how long after a message was published the broker may still deliver it
	// again: for Kafka, the longest retention.ms of the topics the consumers read, plus segment.ms,
	// since a segment is deleted only once its newest record has expired. Required; there is no
	// safe default, because an inbox that forgets a message before the broker does processes it
	// twice.
	BrokerRetention time.Duration
	// InboxRetention is how long the inbox remembers a processed message. It must be longer than
	// BrokerRetention; the difference is the margin for consumer lag and retries. If not
	// specified, defaults to DefaultInboxRetention (15 days): longer than Kafka's defaults allow
	// a redelivery (retention.ms of 7 days plus segment.ms of 7 days).
	InboxRetention time.Duration
	// CallResultRetention is how long the results of side-effect calls are kept for audit and
	// reconciliation. If not specified, defaults to DefaultCallResultRetention (30 days); at least
	// MinCallResultRetention (24h).
	CallResultRetention time.Duration
	// InboxGeneration is how long the inbox inserts into one generation before a pass starts a
	// new one. A generation is dropped whole once its newest row is past the cutoff, so the inbox
	// keeps a row up to InboxGeneration longer than InboxRetention (InboxGeneration/InboxRetention
	// more storage), and a delivery looks for its message in each of the about
	// InboxRetention/InboxGeneration+1 generations alive (one index probe each). A pass rotates at
	// most once, so the generation's time is rounded up to a multiple of Interval. If not
	// specified, defaults to DefaultInboxGeneration (1 day).
	InboxGeneration time.Duration
	// GenerationLockTimeout bounds how long a rotation waits for the deliveries in flight to end:
	// meanwhile new deliveries wait behind it, so it is the longest pause a rotation causes. A
	// rotation that times out (a consumer frozen in its handler holds its transaction open up to
	// inbox.Config.IdleInTransactionTimeout) is retried by the next pass. Keep it below the
	// consumers' inbox.Config.LockTimeout. If not specified, defaults to
	// DefaultGenerationLockTimeout (1s).
	GenerationLockTimeout time.Duration
	// BatchSize is the most rows one DELETE removes. If not specified, defaults to
	// DefaultBatchSize (1000).
	BatchSize int
	// Interval is the time between Run's passes. At least MinInterval (1s); if not specified,
	// defaults to DefaultInterval (1 hour).
	Interval time.Duration
	// Logger receives a line per pass. If not specified, defaults to slog.Default().
	Logger *slog.Logger
}

// Cleaner deletes the rows txbox no longer needs. Create it with New; it is safe for concurrent
// use, and several Cleaners may run against one database (they skip each other's rows).
type Cleaner struct {
	cfg    Config
	schema string // the plain name, for the catalog
	quoted string // the quoted name, for the DDL of generations
	sql    queries
}

// New applies defaults to cfg, validates it and returns a Cleaner.
func New(cfg Config) (*Cleaner, error) {
	if cfg.DB == nil {
		return nil, errors.New("retention: Config.DB is required")
	}
	quoted, err := sqlname.Schema(cfg.Schema)
	if err != nil {
		return nil, fmt.Errorf("retention: Config.Schema: %w", err)
	}
	if cfg.Schema == "" {
		cfg.Schema = sqlname.DefaultSchema
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"BrokerRetention", cfg.BrokerRetention}, {"InboxRetention", cfg.InboxRetention},
		{"CallResultRetention", cfg.CallResultRetention}, {"Interval", cfg.Interval},
		{"InboxGeneration", cfg.InboxGeneration}, {"GenerationLockTimeout", cfg.GenerationLockTimeout},
	} {
		if d.v < 0 {
			return nil, fmt.Errorf("retention: Config.%s must not be negative, got %s", d.name, d.v)
		}
	}
	if cfg.BatchSize < 0 {
		return nil, fmt.Errorf("retention: Config.BatchSize must not be negative, got %d", cfg.BatchSize)
	}
	if cfg.BrokerRetention == 0 {
		return nil, errors.New("retention: Config.BrokerRetention is required: how long the broker may redeliver a message " +
			"(for Kafka, the topics' retention.ms plus segment.ms)")
	}
	if cfg.InboxRetention == 0 {
		cfg.InboxRetention = DefaultInboxRetention
	}
	if cfg.InboxRetention <= cfg.BrokerRetention {
		return nil, fmt.Errorf("retention: Config.InboxRetention (%s) must be longer than Config.BrokerRetention (%s): "+
			"a message the broker redelivers after the inbox forgot it is processed twice", cfg.InboxRetention, cfg.BrokerRetention)
	}
	if cfg.CallResultRetention == 0 {
		cfg.CallResultRetention = DefaultCallResultRetention
	}
	if cfg.CallResultRetention < MinCallResultRetention {
		return nil, fmt.Errorf("retention: Config.CallResultRetention must be at least %s, got %s: the relay measures the replay "+
			"window of an idempotency key used again from the first attempt stored with its result", MinCallResultRetention, cfg.CallResultRetention)
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.Interval == 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.InboxGeneration == 0 {
		cfg.InboxGeneration = DefaultInboxGeneration
	}
	if cfg.GenerationLockTimeout == 0 {
		cfg.GenerationLockTimeout = DefaultGenerationLockTimeout
	}
	if cfg.GenerationLockTimeout < time.Millisecond {
		return nil, fmt.Errorf("retention: Config.GenerationLockTimeout must be at least 1ms, got %s", cfg.GenerationLockTimeout)
	}
	if cfg.Interval < MinInterval {
		return nil, fmt.Errorf("retention: Config.Interval must be at least %s, got %s: Run would repeat its passes without pause", MinInterval, cfg.Interval)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	// Both work, but not as the settings say: worth a word, not a refusal.
	if cfg.Interval > cfg.InboxGeneration {
		cfg.Logger.Warn("retention: Interval is longer than InboxGeneration; a pass starts at most one generation, so each lasts about Interval",
			"interval", cfg.Interval, "inbox_generation", cfg.InboxGeneration)
	}
	if cfg.InboxGeneration > cfg.InboxRetention {
		cfg.Logger.Warn("retention: InboxGeneration is longer than InboxRetention; the current generation, which is never dropped, "+
			"outlives the retention, and its old rows are deleted one by one", "inbox_generation", cfg.InboxGeneration, "inbox_retention", cfg.InboxRetention)
	}
	return &Cleaner{cfg: cfg, schema: cfg.Schema, quoted: quoted, sql: renderQueries(quoted)}, nil
}

// Report tells what one pass deleted and how large the tables are afterwards.
type Report struct {
	// Generation is the inbox's current generation after the pass; Rotated says the pass made it
	// current. RotationDeferred says a rotation was due but timed out waiting for the deliveries in
	// flight (Config.GenerationLockTimeout); the next pass tries again.
	Generation       int64
	Rotated          bool
	RotationDeferred bool
	// GenerationsDropped lists the inbox generations the pass dropped, whole, and
	// GenerationRowsMoved counts the rows of them that had to stay, moved to the current
	// generation first: 'dead' rows whose letter is in the DLQ and rows of redriven messages.
	GenerationsDropped  []int64
	GenerationRowsMoved int64
	// RedrivenKept counts the inbox rows that were due but kept, because their message was
	// redriven since: their receipt time moved forward to the redrive. Like DoneDeleted and
	// DeadDeleted, it counts only rows of the current generation; an older generation's rows stay
	// where they are until it is dropped (and then count in GenerationRowsMoved, or go with it).
	RedrivenKept int64
	// DoneDeleted, DeadDeleted, AttemptsDeleted, RedrivesDeleted and CallResultsDeleted count the
	// rows deleted one by one: processed inbox rows and dead inbox rows whose letter was discarded
	// (both of the current generation only), orphaned attempt counters, records of redrives older
	// than InboxRetention whose message has no letter in the DLQ, and call results.
	DoneDeleted        int64
	DeadDeleted        int64
	AttemptsDeleted    int64
	RedrivesDeleted    int64
	CallResultsDeleted int64
	// DoneCutoff is the receipt time before which processed inbox rows were deleted: InboxRetention
	// before now, or before the oldest letter in the DLQ that consumers may have seen (an inbox
	// letter, a buried relay message's, or a redriven message's that the broker refused) when there
	// is one.
	DoneCutoff time.Time
	// OldestLetterAge is the age of the oldest such letter in the DLQ, by which DoneCutoff was
	// held back; zero when there is none.
	OldestLetterAge time.Duration
	// Tables are the sizes of txbox's tables after the pass (unset when the pass failed).
	Tables []TableSize
	// Duration is how long the pass took.
	Duration time.Duration
}

// TableSize is the size of one table.
type TableSize struct {
	Table string
	// TotalBytes is pg_total_relation_size: the table with its indexes and TOAST.
	TotalBytes int64
	// LiveRows and DeadRows are the cumulative statistics' estimates, which trail the latest writes
	// by a moment; dead rows are bloat that VACUUM has yet to reclaim.
	LiveRows int64
	DeadRows int64
}

// RunOnce starts a new inbox generation when one is due and drops the old generations whose
// newest row is past the cutoff (see the package documentation). In the current generation, it
// then keeps the inbox rows of messages redriven within InboxRetention, or with a letter waiting
// since their redrive. Then it deletes, in batches of BatchSize rows each committed on its own:
//   - inbox rows of the current generation in state 'done' received before the cutoff (see the
//     package documentation);
//   - inbox rows of the current generation in state 'dead' older than InboxRetention whose letter
//     is no longer in the DLQ;
//   - attempt counters of settled messages, or with no delivery for InboxRetention;
//   - records of redrives older than InboxRetention whose message has no letter in the DLQ;
//   - call results older than CallResultRetention.
//
// It returns what it did, with the table sizes, even when it stops early on an error or ctx.
func (c *Cleaner) RunOnce(ctx context.Context) (Report, error) {
	start := time.Now()
	var (
		rep                           Report
		now, deadCutoff, callCutoff   time.Time
		oldest                        *time.Time
		inboxMicros, callResultMicros = c.cfg.InboxRetention.Microseconds(), c.cfg.CallResultRetention.Microseconds()
		err                           error
	)
	err = c.cfg.DB.QueryRow(ctx, c.sql.cutoffs, inboxMicros, callResultMicros).
		Scan(&now, &rep.DoneCutoff, &deadCutoff, &callCutoff, &oldest)
	if err != nil {
		return rep, fmt.Errorf("retention: read cutoffs: %w", err)
	}
	if oldest != nil && oldest.Before(now) {
		rep.OldestLetterAge = now.Sub(*oldest)
	}

	if err = c.rotate(ctx, &rep); err != nil {
		err = fmt.Errorf("retention: start an inbox generation: %w", err)
	} else if err = c.dropGenerations(ctx, &rep, deadCutoff); err != nil {
		err = fmt.Errorf("retention: drop inbox generations: %w", err)
	}
	for _, step := range []struct {
		what   string
		sql    string
		cutoff time.Time
		count  *int64
	}{
		{"keep inbox rows of redriven messages", c.inGeneration(c.sql.keepRedriven, rep.Generation), deadCutoff, &rep.RedrivenKept},
		{"delete processed inbox rows", c.inGeneration(c.sql.deleteDone, rep.Generation), rep.DoneCutoff, &rep.DoneDeleted},
		{"delete dead inbox rows", c.inGeneration(c.sql.deleteDead, rep.Generation), deadCutoff, &rep.DeadDeleted},
		{"delete inbox attempt counters", c.sql.deleteAttempts, deadCutoff, &rep.AttemptsDeleted},
		{"delete redrive records", c.sql.deleteRedrives, deadCutoff, &rep.RedrivesDeleted},
		{"delete call results", c.sql.deleteCallResults, callCutoff, &rep.CallResultsDeleted},
	} {
		if err != nil {
			break
		}
		if err = c.inBatches(ctx, step.sql, step.cutoff, step.count); err != nil {
			err = fmt.Errorf("retention: %s: %w", step.what, err)
			break
		}
	}

	if err == nil {
		rep.Tables, err = TableSizes(ctx, c.cfg.DB, c.schema)
	}
	rep.Duration = time.Since(start)
	c.log(rep, err)
	return rep, err
}

// rotate makes a new generation of the inbox current when the current one is due
// (Config.InboxGeneration): it makes and attaches the new partition, then switches once no
// delivery inserts into the old one (internal/inboxgen), all in one transaction, so a rotation
// that times out leaves nothing behind.
func (c *Cleaner) rotate(ctx context.Context, rep *Report) error {
	tx, err := c.cfg.DB.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // A no-op after Commit.
	var due bool
	lockTimeout := strconv.FormatInt(c.cfg.GenerationLockTimeout.Milliseconds(), 10)
	err = tx.QueryRow(ctx, c.sql.lockGenerationRow, c.cfg.InboxGeneration.Microseconds(), lockTimeout).Scan(&rep.Generation, &due)
	if err != nil || !due {
		return c.deferred(rep, err)
	}
	next := rep.Generation + 1
	for _, stmt := range append(newGenerationDDL(c.quoted, c.generationTable(next), next), c.sql.lockGenerations, c.sql.lockEarlierDeliveries) {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			return c.deferred(rep, err)
		}
	}
	if _, err := tx.Exec(ctx, c.sql.newGeneration, next); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	rep.Generation, rep.Rotated = next, true
	return nil
}

// deferred returns err, or notes a rotation deferred when err is a lock timeout.
func (c *Cleaner) deferred(rep *Report, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		rep.RotationDeferred = true
		return nil
	}
	return err
}

func (c *Cleaner) generationTable(generation int64) string {
	return c.quoted + "." + pgx.Identifier{generationPrefix + strconv.FormatInt(generation, 10)}.Sanitize()
}

// inGeneration fills in the table of generation in a statement that names it (sql.go).
func (c *Cleaner) inGeneration(sql string, generation int64) string {
	return strings.ReplaceAll(sql, generationPlaceholder, c.generationTable(generation))
}

// dropGenerations drops every generation older than the current one whose newest row is past the
// 'done' cutoff, once the rows that must stay moved out of it (moveDeadSQL, moveRedrivenSQL). It
// detaches a generation CONCURRENTLY: that waits for the transactions that may still read it
// without blocking any other, where a plain DROP would lock the whole inbox while it waits. It
// first finishes the detaches and drops an interrupted pass left.
func (c *Cleaner) dropGenerations(ctx context.Context, rep *Report, deadCutoff time.Time) error {
	pending, err := c.names(ctx, c.sql.pendingDetaches)
	if err != nil {
		return fmt.Errorf("list interrupted detaches: %w", err)
	}
	for _, name := range pending {
		if _, err := c.cfg.DB.Exec(ctx, finalizeDetachDDL(c.quoted, c.quoted+"."+pgx.Identifier{name}.Sanitize())); err != nil {
			return fmt.Errorf("finish the detach of %s: %w", name, err)
		}
	}
	detached, err := c.names(ctx, c.sql.detachedTables)
	if err != nil {
		return fmt.Errorf("list detached generations: %w", err)
	}
	for _, name := range detached {
		if _, err := c.cfg.DB.Exec(ctx, dropDDL(c.quoted+"."+pgx.Identifier{name}.Sanitize())); err != nil {
			return fmt.Errorf("drop %s: %w", name, err)
		}
	}

	rows, err := c.cfg.DB.Query(ctx, c.sql.generations)
	if err != nil {
		return fmt.Errorf("list generations: %w", err)
	}
	var current int64
	generations, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (int64, error) {
		var g int64
		return g, r.Scan(&g, &current)
	})
	if err != nil {
		return fmt.Errorf("list generations: %w", err)
	}
	// A rotation deferred by another Cleaner's, which held the control row, could not read it.
	rep.Generation = current
	var redrives bool
	if err := c.cfg.DB.QueryRow(ctx, c.sql.recentRedrives, deadCutoff).Scan(&redrives); err != nil {
		return fmt.Errorf("look for recent redrives: %w", err)
	}
	for _, g := range generations {
		if g >= current {
			continue
		}
		var newest *time.Time
		if err := c.cfg.DB.QueryRow(ctx, c.sql.newestInGeneration, g).Scan(&newest); err != nil {
			return fmt.Errorf("read the newest row of generation %d: %w", g, err)
		}
		if newest != nil && !newest.Before(rep.DoneCutoff) {
			continue
		}
		if err := c.move(ctx, rep, c.sql.moveDead, g); err != nil {
			return fmt.Errorf("move the dead rows of generation %d: %w", g, err)
		}
		if redrives {
			if err := c.move(ctx, rep, c.sql.moveRedriven, deadCutoff, g); err != nil {
				return fmt.Errorf("move the redriven rows of generation %d: %w", g, err)
			}
		}
		table := c.generationTable(g)
		if _, err := c.cfg.DB.Exec(ctx, detachDDL(c.quoted, table)); err != nil {
			return fmt.Errorf("detach generation %d: %w", g, err)
		}
		if _, err := c.cfg.DB.Exec(ctx, dropDDL(table)); err != nil {
			return fmt.Errorf("drop generation %d: %w", g, err)
		}
		rep.GenerationsDropped = append(rep.GenerationsDropped, g)
	}
	return nil
}

func (c *Cleaner) move(ctx context.Context, rep *Report, sql string, args ...any) error {
	tag, err := c.cfg.DB.Exec(ctx, sql, args...)
	rep.GenerationRowsMoved += tag.RowsAffected()
	return err
}

// names runs a catalog query that returns relation names.
func (c *Cleaner) names(ctx context.Context, sql string) ([]string, error) {
	rows, err := c.cfg.DB.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// inBatches runs a batch statement until a batch comes back short. Each batch is its own
// statement: locks last one batch, and VACUUM can reclaim the rows while the pass goes on.
func (c *Cleaner) inBatches(ctx context.Context, sql string, cutoff time.Time, count *int64) error {
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		tag, err := c.cfg.DB.Exec(ctx, sql, cutoff, c.cfg.BatchSize)
		if err != nil {
			return err
		}
		*count += tag.RowsAffected()
		if tag.RowsAffected() < int64(c.cfg.BatchSize) {
			return nil
		}
	}
}

func (c *Cleaner) log(rep Report, err error) {
	attrs := []any{
		"generation", rep.Generation, "rotated", rep.Rotated, "generations_dropped", rep.GenerationsDropped,
		"generation_rows_moved", rep.GenerationRowsMoved,
		"redriven_kept", rep.RedrivenKept, "done_deleted", rep.DoneDeleted, "dead_deleted", rep.DeadDeleted,
		"attempts_deleted", rep.AttemptsDeleted, "redrives_deleted", rep.RedrivesDeleted,
		"call_results_deleted", rep.CallResultsDeleted,
		"duration", rep.Duration.Round(time.Millisecond),
	}
	for _, t := range rep.Tables {
		attrs = append(attrs, t.Table+"_bytes", t.TotalBytes, t.Table+"_dead_rows", t.DeadRows)
	}
	if err != nil {
		c.cfg.Logger.Error("retention pass failed", append(attrs, "error", err)...)
		return
	}
	c.cfg.Logger.Info("retention pass", attrs...)
	if rep.RotationDeferred {
		c.cfg.Logger.Warn("a new inbox generation was due, but deliveries in flight held it back past GenerationLockTimeout; the next pass tries again",
			"generation", rep.Generation, "generation_lock_timeout", c.cfg.GenerationLockTimeout)
	}
	if rep.OldestLetterAge > c.cfg.InboxRetention {
		c.cfg.Logger.Warn("the oldest letter in the DLQ a consumer may have seen keeps processed inbox rows beyond InboxRetention; redrive or discard it",
			"oldest_letter_age", rep.OldestLetterAge.Round(time.Second), "inbox_retention", c.cfg.InboxRetention)
	}
}

// Run runs a pass at once and then every Interval until ctx is cancelled, and returns nil then.
// A failed pass is logged and retried at the next interval.
func (c *Cleaner) Run(ctx context.Context) error {
	tick := time.NewTicker(c.cfg.Interval)
	defer tick.Stop()
	for {
		_, _ = c.RunOnce(ctx) // Logged by RunOnce.
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// Querier is the part of pgx that TableSizes needs.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// TableSizes returns the sizes of txbox's outbox, inbox, inbox attempt, DLQ, redrive and call result
// tables in schema ("" means "public"), in that order; a table that does not exist is left out.
func TableSizes(ctx context.Context, db Querier, schema string) ([]TableSize, error) {
	if _, err := sqlname.Schema(schema); err != nil {
		return nil, fmt.Errorf("retention: %w", err)
	}
	if schema == "" {
		schema = sqlname.DefaultSchema
	}
	rows, err := db.Query(ctx, tableSizesSQL, schema, tables)
	if err != nil {
		return nil, fmt.Errorf("retention: table sizes: %w", err)
	}
	sizes, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (TableSize, error) {
		var t TableSize
		err := r.Scan(&t.Table, &t.TotalBytes, &t.LiveRows, &t.DeadRows)
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("retention: table sizes: %w", err)
	}
	return sizes, nil
}
