package chaos_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/kafkatest"
	"github.com/txbox/txbox/internal/proctest"
	"github.com/txbox/txbox/internal/txtest"
	"github.com/txbox/txbox/relay"
	"github.com/txbox/txbox/stripetest"
)

var (
	seedFlag       = flag.Uint64("chaos.seed", 0, "seed of TestChaos's first iteration (default: $"+seedEnvVar+", else random)")
	iterationsFlag = flag.Int("chaos.iterations", 3, "iterations of TestChaos; each takes 10-20s")
)

// seedEnvVar replays TestChaos from a seed, like -chaos.seed.
const seedEnvVar = "TXBOX_CHAOS_SEED"

// The failpoints a process can be killed at, and the highest hit count an incarnation arms.
var (
	relayFailpoints = []string{
		"relay.before-open", "relay.after-read", "kafka.before-commit", "relay.after-publish", "relay.lease-locked",
		"relay.after-complete", "call.before-send", "call.after-send", "call.after-complete",
	}
	inboxFailpoints = []string{"inbox.after-insert", "inbox.after-handler", "inbox.before-commit", "inbox.after-commit"}
)

const (
	leaseTTL    = time.Second
	relays      = 2
	incarnation = 200 // failpoint plans per process; incarnations beyond run without one
)

var consumers = []string{"billing", "shipping"}

// plan is everything an iteration decides at random, derived from its seed alone.
type plan struct {
	seed      uint64
	duration  time.Duration   // of the chaos phase
	keys      []string        // partition keys; "" (no key) among them
	producers [][]transaction // per producer; each key belongs to one producer
	faults    map[string][]fault
	events    []event
	batchSize []int              // per relay
	last      []*message.Message // one per key, written once the chaos is over
}

type transaction struct {
	after  time.Duration // pause before it
	msgs   []*message.Message
	hold   time.Duration // held open before committing, so later transactions commit first
	commit bool
}

type event struct {
	at      time.Duration
	program string
	pause   time.Duration // 0: SIGKILL; else SIGSTOP for this long
}

func newPlan(seed uint64) plan {
	rng := rand.New(rand.NewPCG(seed, 0x74786278))
	p := plan{seed: seed, duration: time.Duration(5000+rng.IntN(4000)) * time.Millisecond, faults: map[string][]fault{}}

	p.keys = []string{""}
	for i := range 3 + rng.IntN(4) {
		p.keys = append(p.keys, fmt.Sprintf("key-%d", i))
	}
	p.producers = make([][]transaction, 2)
	for pi := range p.producers {
		var spent time.Duration
		for spent < p.duration*8/10 {
			key := p.keys[rng.IntN(len(p.keys))]
			for p.ownerOf(key) != pi {
				key = p.keys[rng.IntN(len(p.keys))]
			}
			tx := transaction{after: time.Duration(20+rng.IntN(150)) * time.Millisecond, commit: rng.IntN(10) > 0}
			if rng.IntN(5) == 0 {
				tx.hold = time.Duration(rng.IntN(200)) * time.Millisecond
			}
			for range 1 + rng.IntN(4) {
				tx.msgs = append(tx.msgs, keyed(randomUUID(rng), key, "chaos"))
			}
			spent += tx.after + tx.hold
			p.producers[pi] = append(p.producers[pi], tx)
		}
	}

	for _, key := range p.keys {
		p.last = append(p.last, keyed(randomUUID(rng), key, "last"))
	}

	var programs []string
	for i := range relays {
		name := fmt.Sprintf("relay-%d", i)
		programs = append(programs, name)
		p.faults[name] = faults(rng, relayFailpoints, 8, leaseTTL)
		p.batchSize = append(p.batchSize, []int{1, 3, 10, 100}[rng.IntN(4)])
	}
	for _, c := range consumers {
		programs = append(programs, c)
		p.faults[c] = faults(rng, inboxFailpoints, 10, 500*time.Millisecond)
	}
	for at := time.Duration(0); ; {
		at += time.Duration(300+rng.IntN(1200)) * time.Millisecond
		if at >= p.duration {
			break
		}
		e := event{at: at, program: programs[rng.IntN(len(programs))]}
		if strings.HasPrefix(e.program, "relay") && rng.IntN(3) == 0 {
			e.pause = leaseTTL + time.Duration(rng.IntN(1500))*time.Millisecond // past the lease: a zombie
		}
		p.events = append(p.events, e)
	}
	return p
}

// faults plans the failpoint of each incarnation: three in four arm one, on a hit from 1 to maxHit.
// One in four of those stops the process instead of killing it, for minStop to minStop+1.5s: a
// relay stopped for longer than its lease comes back as a zombie. The first incarnation always
// arms a kill on an early hit, so every iteration crashes at some step.
func faults(rng *rand.Rand, names []string, maxHit int, minStop time.Duration) []fault {
	out := make([]fault, incarnation)
	for i := range out {
		if i > 0 && rng.IntN(4) == 0 {
			continue
		}
		name, hit := names[rng.IntN(len(names))], 1+rng.IntN(maxHit)
		if i == 0 {
			hit = 1 + rng.IntN(2)
		}
		if i > 0 && rng.IntN(4) == 0 {
			out[i] = fault{spec: name + "=" + failpoint.Stop + "@" + strconv.Itoa(hit), resume: minStop + time.Duration(rng.IntN(1500))*time.Millisecond}
			continue
		}
		out[i] = fault{spec: name + "@" + strconv.Itoa(hit)}
	}
	return out
}

func (p plan) ownerOf(key string) int {
	return slices.Index(p.keys, key) % len(p.producers)
}

func randomUUID(rng *rand.Rand) string {
	var b [16]byte
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	u, _ := uuid.FromBytes(b[:])
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80 // RFC 4122 variant
	return u.String()
}

func (p plan) String() string {
	msgs, txs := 0, 0
	for _, producer := range p.producers {
		for _, tx := range producer {
			txs++
			msgs += len(tx.msgs)
		}
	}
	var ev []string
	for _, e := range p.events {
		what := "kill"
		if e.pause > 0 {
			what = "pause " + e.pause.String()
		}
		ev = append(ev, fmt.Sprintf("%s@%s %s", e.program, e.at, what))
	}
	var first []string
	for _, name := range slices.Sorted(maps.Keys(p.faults)) {
		var specs []string
		for _, f := range p.faults[name][:3] {
			specs = append(specs, f.spec)
		}
		first = append(first, name+": "+strings.Join(specs, ","))
	}
	return fmt.Sprintf("chaos %s, %d keys, %d transactions with %d messages, batch sizes %v, failpoints %s…, events [%s]",
		p.duration, len(p.keys), txs, msgs, p.batchSize, strings.Join(first, " "), strings.Join(ev, ", "))
}

// TestChaos runs relays and consumers as OS processes under a supervisor that restarts them, while
// producers in the test write keyed messages, and each consumer's handler writes a Stripe charge
// per message that the relays execute against the Stripe test double. Processes die at random
// failpoints of the relay, the call executor and the inbox, are killed with SIGKILL at random
// times, and relays are frozen with SIGSTOP past their lease (zombies). Then the chaos stops, the
// system drains, and chaos.Check must find every invariant intact.
//
// Every iteration logs its seed; -chaos.seed=N (or TXBOX_CHAOS_SEED=N) replays it.
func TestChaos(t *testing.T) {
	t.Parallel()
	seed := *seedFlag
	if seed == 0 {
		if env := os.Getenv(seedEnvVar); env != "" {
			var err error
			seed, err = strconv.ParseUint(env, 10, 64)
			require.NoError(t, err, seedEnvVar)
		} else {
			seed = rand.Uint64() >> 1
		}
	}
	total := map[string]int{}
	for i := range uint64(max(*iterationsFlag, 0)) {
		s := seed + i
		var stats map[string]int
		if !t.Run(fmt.Sprintf("seed=%d", s), func(t *testing.T) { stats = iterate(t, newPlan(s)) }) {
			t.Fatalf("seed=%d failed; replay it with: go test ./internal/chaos -run '^TestChaos$' -count=1 -args -chaos.seed=%d -chaos.iterations=1", s, s)
		}
		for k, v := range stats {
			total[k] += v
		}
	}
	t.Logf("failpoints that fired over %d iterations: %v", *iterationsFlag, total)
}

// iterate runs one plan and returns how often each failpoint fired (kills by name, stops as name=stop).
func iterate(t *testing.T, p plan) map[string]int {
	t.Logf("seed=%d", p.seed)
	t.Logf("plan: %s", p)
	ctx := context.Background()
	b := newBundle(t, txtest.New(t))
	stripe := stripetest.New(stripetest.Options{})
	t.Cleanup(stripe.Close)
	brokers := strings.Join(kafkatest.Brokers(t), ",")

	programs := map[string]*program{}
	for i := range relays {
		name := fmt.Sprintf("relay-%d", i)
		programs[name] = supervise(t, name, proctest.Binary(t), []string{"relay",
			"--database-url", b.env.URL, "--schema", b.env.Schema, "--kafka-brokers", brokers,
			"--transactional-id-prefix", b.env.Schema, "--shards", "4", "--lease-ttl", leaseTTL.String(),
			"--poll-interval", "10ms", "--batch-size", strconv.Itoa(p.batchSize[i]), "--metrics-addr", "",
			"--stripe-base-url", stripe.URL(),
		}, []string{relay.APIKeyEnvVar + "=" + stripetest.TestKey}, p.faults[name])
	}
	for _, c := range consumers {
		// Crash loops at a failpoint count as attempts; the limit must outlast the chaos phase.
		programs[c] = supervise(t, c, consumerBinary(t), b.consumerArgs(t, c, "--max-attempts", "1000", "--charge"), nil, p.faults[c])
	}

	// Chaos: producers write while the schedule kills and pauses processes.
	var (
		wg         sync.WaitGroup
		mu         sync.Mutex
		rolledBack []string
		errs       []error
	)
	began := time.Now()
	for _, txs := range p.producers {
		wg.Go(func() {
			for _, tx := range txs {
				time.Sleep(tx.after) // Pacing the plan, not waiting for a condition.
				if err := b.write(ctx, tx.msgs, tx.commit, tx.hold); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
				if !tx.commit {
					mu.Lock()
					for _, m := range tx.msgs {
						rolledBack = append(rolledBack, m.UUID)
					}
					mu.Unlock()
				}
			}
		})
	}
	for _, e := range p.events {
		time.Sleep(time.Until(began.Add(e.at)))
		if e.pause > 0 {
			programs[e.program].pause(e.pause)
		} else {
			programs[e.program].kill()
		}
	}
	wg.Wait()
	require.NoError(t, errors.Join(errs...), "producers")

	// Calm: no more failpoints for new incarnations, and one last message per key: once it is
	// applied, every copy of the key's earlier messages, republished or not, has been consumed.
	for _, pr := range programs {
		pr.calmDown()
	}
	for _, m := range p.last {
		require.NoError(t, b.write(ctx, []*message.Message{m}, true, 0))
	}
	last := time.Now()
	drained := assert.Eventually(t, func() bool {
		if time.Since(last) > 5*time.Second {
			last = time.Now()
			missing, pending, err := b.backlog(ctx, consumers)
			t.Logf("%s: %d applications missing, %d outbox rows pending, %v", time.Since(began).Round(time.Millisecond), missing, pending, err)
		}
		return b.settled(ctx, consumers)
	}, 2*time.Minute, 50*time.Millisecond,
		"every committed message applied by every consumer, and the outbox drained")
	t.Logf("chaos %s, drained after %s", p.duration, time.Since(began).Round(time.Millisecond))
	if !drained {
		var groups []string
		for _, c := range consumers {
			groups = append(groups, c+"-"+b.env.Schema)
		}
		t.Logf("consumer groups:\n%s", describeGroups(kafkatest.Brokers(t), b.topic, groups))
	}

	deaths, stops := map[string]int{}, map[string]int{}
	for _, name := range slices.Sorted(maps.Keys(programs)) {
		pr := programs[name]
		stopping := time.Now()
		pr.stop(20 * time.Second)
		s := pr.snapshot()
		t.Logf("%s: %s; stopped in %s", name, s, time.Since(stopping).Round(time.Millisecond))
		assert.Empty(t, s.unexpected, "%s exited unexpectedly", name)
		assert.Zero(t, s.crashes, "%s died without a failpoint or a kill", name)
		for fp, n := range s.failpoints {
			deaths[fp] += n
		}
		for fp, n := range s.stops {
			stops[fp+"=stop"] += n
		}
	}
	o := b.outcome(t, consumers)
	o.RolledBack, o.Charges = rolledBack, stripe.ChargesFor
	requireNoViolations(t, o)
	require.NotEmpty(t, deaths, "no process died at a failpoint: the chaos did not happen")
	require.Equal(t, len(o.Committed)*len(consumers), stripe.TotalCharges(), "no charge beyond one per message and consumer")
	maps.Copy(deaths, stops)
	return deaths
}
