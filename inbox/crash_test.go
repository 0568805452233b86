package inbox_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/internal/failpoint"
)

var errCrash = errors.New("the process crashed")

// process is one run of a consumer process, from its start to its crash: an Inbox of its own (a
// restarted process starts with nothing in memory) over a database that it stops reaching when it
// dies. A crash is simulated by its consequences: the handlers in flight unwind without ending their
// attempts (they panic), their transactions are rolled back as PostgreSQL rolls back those of a lost
// connection, and nothing the process would have done afterwards reaches the database.
type process struct {
	dead chan struct{}
	once sync.Once
}

func (p *process) crash() { p.once.Do(func() { close(p.dead) }) }

func (p *process) alive() bool {
	select {
	case <-p.dead:
		return false
	default:
		return true
	}
}

// mortalDB is the database as a process sees it: unreachable once the process died.
type mortalDB struct {
	inbox.DB
	p *process
}

func (d mortalDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if !d.p.alive() {
		return pgx.FailedBatchResults(b, errCrash)
	}
	return d.DB.SendBatch(ctx, b)
}

func (d mortalDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if !d.p.alive() {
		return pgconn.CommandTag{}, errCrash
	}
	return d.DB.Exec(ctx, sql, args...)
}

func (d mortalDB) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !d.p.alive() {
		return deadRow{}
	}
	return d.DB.QueryRow(ctx, sql, args...)
}

type deadRow struct{}

func (deadRow) Scan(...any) error { return errCrash }

// A message that crashes its process every time, and an innocent one that is in flight with it
// whenever they can be: in the process's first run both run side by side, so the crash cannot be
// told apart, and in every later run the poison waits for the innocent to be in its handler, or
// waiting to run, before it crashes. The poison is dead-lettered after exactly MaxAttempts crashes;
// the innocent is processed once and never dead-lettered, however many of the poison's crashes it
// was in flight for. After a duplicate, deliveries send their marker alone before they open the
// handler's transaction (see Inbox.handle): each process then starts with one.
func TestACrashIsChargedToTheMessageThatCausedIt(t *testing.T) {
	t.Parallel()
	for name, afterDuplicate := range map[string]bool{"marker-in-pipeline": false, "marker-alone": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testACrashIsChargedToTheMessageThatCausedIt(t, afterDuplicate)
		})
	}
}

func testACrashIsChargedToTheMessageThatCausedIt(t *testing.T, afterDuplicate bool) {
	b := setup(t, nil) // MaxAttempts: 3
	processed := newMessage()
	require.NoError(t, deliver(b.inbox.Middleware(b.handler(nil)), processed))
	poison, innocent := newMessage(), newMessage()
	var poisonRuns atomic.Int64
	settled := func() bool {
		return b.count(t, "txbox_dlq", "uuid = $1", poison.UUID) == 1 && b.count(t, "effects", "id = $1", innocent.UUID) == 1
	}
	var unexpected []any
	for run := 0; run < 10 && !settled(); run++ {
		p := &process{dead: make(chan struct{})}
		ib, err := inbox.New(inbox.Config{DB: mortalDB{b.env.Pool, p}, Consumer: "billing", Schema: b.env.Schema, MaxAttempts: 3, StatsInterval: -1}, nil)
		require.NoError(t, err)
		innocentIn, innocentWaits, innocentBlocked, innocentDone := make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
		poisonWaits, poisonBlocked, poisonDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
		h := ib.Middleware(b.handler(func(msg *message.Message) error {
			if msg.UUID == poison.UUID {
				poisonRuns.Add(1)
				select {
				case <-innocentIn:
				case <-innocentWaits:
				case <-innocentBlocked: // Behind this one, which runs alone: it cannot be in flight.
				case <-innocentDone:
				}
				p.crash()
				panic(errCrash)
			}
			close(innocentIn)
			select {
			case <-p.dead:
			case <-poisonWaits: // It cannot run before this one ends.
			case <-poisonDone:
			case <-innocentWaits: // This one runs alone: the poison cannot be in flight beside it.
			}
			if !p.alive() {
				panic(errCrash)
			}
			return nil
		}))
		var mu sync.Mutex
		// deliver delivers msg in a goroutine of its own, as a router does with several partitions.
		deliver := func(msg *message.Message, waits, blocked, done chan struct{}) {
			ctx := withDeliveryHooks(waits, blocked)
			go func() {
				defer close(done)
				defer func() {
					if r := recover(); r != nil && r != errCrash {
						mu.Lock()
						unexpected = append(unexpected, r)
						mu.Unlock()
					}
				}()
				_ = deliverCtx(ctx, h, msg)
			}()
		}
		if afterDuplicate {
			require.NoError(t, deliverCtx(context.Background(), h, processed))
		}
		deliver(innocent, innocentWaits, innocentBlocked, innocentDone)
		deliver(poison, poisonWaits, poisonBlocked, poisonDone)
		<-innocentDone
		<-poisonDone
	}
	require.Empty(t, unexpected)
	require.Equal(t, 1, b.count(t, "effects", "id = $1", innocent.UUID), "the innocent message is processed")
	require.Zero(t, b.count(t, "txbox_dlq", "uuid = $1", innocent.UUID), "the innocent message is not dead-lettered")
	require.Equal(t, 1, b.count(t, "txbox_dlq", "uuid = $1 AND reason = $2 AND attempts = 3", poison.UUID, inbox.ReasonAttemptsExhausted))
	require.Equal(t, int64(3), poisonRuns.Load(), "the poison crashed its process once per attempt")
	require.Zero(t, b.count(t, "txbox_inbox_attempt", ""), "both counters are settled")
}

// Two messages that each crash their process every time, once the other is in flight or waiting to
// run alone: a suspect waiting to run alone while the other runs alone and crashes was not in
// flight for that crash, and is not charged for it. Each is dead-lettered after its own crashes,
// exactly MaxAttempts attempts.
func TestACrashWhileASuspectWaitsToRunAloneIsNotChargedToIt(t *testing.T) {
	t.Parallel()
	b := setup(t, nil) // MaxAttempts: 3
	poisons := [2]*message.Message{newMessage(), newMessage()}
	settled := func() bool {
		return b.count(t, "txbox_dlq", "uuid IN ($1, $2)", poisons[0].UUID, poisons[1].UUID) == 2
	}
	var unexpected atomic.Value
	for run := 0; run < 10 && !settled(); run++ {
		p := &process{dead: make(chan struct{})}
		ib, err := inbox.New(inbox.Config{DB: mortalDB{b.env.Pool, p}, Consumer: "billing", Schema: b.env.Schema, MaxAttempts: 3, StatsInterval: -1}, nil)
		require.NoError(t, err)
		var in, waits, blocked, done [2]chan struct{}
		for i := range 2 {
			in[i], waits[i], blocked[i], done[i] = make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
		}
		h := ib.Middleware(b.handler(func(msg *message.Message) error {
			i := 0
			if msg.UUID == poisons[1].UUID {
				i = 1
			}
			close(in[i])
			select {
			case <-in[1-i]:
			case <-waits[1-i]:
			case <-blocked[1-i]:
			case <-done[1-i]:
			}
			p.crash()
			panic(errCrash)
		}))
		for i, msg := range poisons {
			ctx := withDeliveryHooks(waits[i], blocked[i])
			go func() {
				defer close(done[i])
				defer func() {
					if r := recover(); r != nil && r != errCrash {
						unexpected.Store(r)
					}
				}()
				_ = deliverCtx(ctx, h, msg)
			}()
		}
		<-done[0]
		<-done[1]
	}
	require.Nil(t, unexpected.Load())
	for _, msg := range poisons {
		require.Equal(t, 1, b.count(t, "txbox_dlq", "uuid = $1 AND reason = $2 AND attempts = 3", msg.UUID, inbox.ReasonAttemptsExhausted),
			"%s is dead-lettered after its own 3 attempts", msg.UUID)
	}
}

// withDeliveryHooks returns a context under which a delivery closes waits when it is about to wait
// to run alone, and blocked when it finds a suspect running alone (or about to) and waits for it
// before it can start: a message that waits for another to be in flight must stop waiting then.
func withDeliveryHooks(waits, blocked chan struct{}) context.Context {
	var waiting, behind sync.Once
	ctx := failpoint.WithHook(context.Background(), "inbox.before-run-alone", func() { waiting.Do(func() { close(waits) }) })
	return failpoint.WithHook(ctx, "inbox.waits-for-suspect", func() { behind.Do(func() { close(blocked) }) })
}
