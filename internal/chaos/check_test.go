package chaos_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/chaos"
)

// goodOutcome is a run that kept every invariant: three messages on key k (two consumers, one
// redelivery deduplicated away), one without a key, one rolled back.
func goodOutcome() chaos.Outcome {
	committed := []chaos.Message{{UUID: "m1", Key: "k"}, {UUID: "m2", Key: "k"}, {UUID: "m3", Key: "k"}, {UUID: "n1", Key: ""}}
	var effects []chaos.Effect
	for _, c := range []string{"a", "b"} {
		for _, m := range committed {
			effects = append(effects, chaos.Effect{Consumer: c, UUID: m.UUID, Key: m.Key})
		}
	}
	charges := map[string]int{}
	for _, c := range []string{"a", "b"} {
		for _, m := range committed {
			charges[chaos.ChargeKey(c, m.UUID)] = 1
		}
	}
	return chaos.Outcome{
		Committed: committed, RolledBack: []string{"r1"}, Consumers: []string{"a", "b"}, Effects: effects,
		Charges: func(key string) int { return charges[key] },
	}
}

func kinds(vs []chaos.Violation) []string {
	var out []string
	for _, v := range vs {
		out = append(out, v.Kind+" "+v.Consumer+" "+v.UUID)
	}
	return out
}

func TestCheckAcceptsAGoodOutcome(t *testing.T) {
	t.Parallel()
	require.Empty(t, chaos.Check(goodOutcome()))
}

// The checker must be able to fail: fed a run with a double effect and a lost message, it reports
// both, and each other kind of breakage too.
func TestCheckReportsBrokenOutcomes(t *testing.T) {
	t.Parallel()

	t.Run("double effect and lost row", func(t *testing.T) {
		o := goodOutcome()
		o.Effects = append(o.Effects, chaos.Effect{Consumer: "a", UUID: "m2", Key: "k"}) // applied twice
		o.Effects = deleteEffect(o.Effects, "b", "m3")                                   // never applied
		require.ElementsMatch(t, []string{"duplicate a m2", "lost b m3"}, kinds(chaos.Check(o)))
	})
	t.Run("order", func(t *testing.T) {
		o := goodOutcome()
		o.Effects = deleteEffect(o.Effects, "a", "m1")
		o.Effects = append(o.Effects, chaos.Effect{Consumer: "a", UUID: "m1", Key: "k"}) // m1 first applied after m3
		require.ElementsMatch(t, []string{"order a m2"}, kinds(chaos.Check(o)))
	})
	t.Run("a later copy does not break order", func(t *testing.T) {
		o := goodOutcome()
		o.Effects = append(o.Effects, chaos.Effect{Consumer: "b", UUID: "m1", Key: "k"})
		require.ElementsMatch(t, []string{"duplicate b m1"}, kinds(chaos.Check(o)))
	})
	t.Run("phantom", func(t *testing.T) {
		o := goodOutcome()
		o.Effects = append(o.Effects, chaos.Effect{Consumer: "b", UUID: "r1", Key: "k"}, chaos.Effect{Consumer: "a", UUID: "x", Key: "k"})
		vs := chaos.Check(o)
		require.ElementsMatch(t, []string{"phantom b r1", "phantom a x"}, kinds(vs))
		require.Contains(t, vs[0].String()+vs[1].String(), "rolled back")
	})
	t.Run("pending and dead", func(t *testing.T) {
		o := goodOutcome()
		o.Pending = 2
		o.DeadLetters = []chaos.DeadLetter{{UUID: "m1", Reason: "attempts exhausted"}}
		require.ElementsMatch(t, []string{"pending  ", "dead  m1"}, kinds(chaos.Check(o)))
	})
	t.Run("charges", func(t *testing.T) {
		o := goodOutcome()
		good := o.Charges
		o.Charges = func(key string) int {
			switch key {
			case chaos.ChargeKey("a", "m1"):
				return 2
			case chaos.ChargeKey("b", "n1"):
				return 0
			}
			return good(key)
		}
		require.ElementsMatch(t, []string{"charges a m1", "charges b n1"}, kinds(chaos.Check(o)))
	})
}

func deleteEffect(effects []chaos.Effect, consumer, uuid string) []chaos.Effect {
	var out []chaos.Effect
	for _, e := range effects {
		if e.Consumer != consumer || e.UUID != uuid {
			out = append(out, e)
		}
	}
	return out
}
