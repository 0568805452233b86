package failpoint

import (
	"context"
	"testing"
)

func TestParse(t *testing.T) {
	got := parse(" relay.after-publish, kafka.before-commit=stop@3,relay.lease-locked@2 ,x=kill@0")
	want := map[string]point{
		"relay.after-publish": {nth: 1, action: Kill},
		"kafka.before-commit": {nth: 3, action: Stop},
		"relay.lease-locked":  {nth: 2, action: Kill},
		"x":                   {nth: 1, action: Kill},
	}
	if len(got) != len(want) {
		t.Fatalf("parse: got %v, want %v", got, want)
	}
	for name, p := range want {
		if got[name] != p {
			t.Errorf("parse %s: got %+v, want %+v", name, got[name], p)
		}
	}
	if parse("") != nil {
		t.Error("an empty spec arms nothing")
	}
}

func TestHooksAreScopedToTheirContext(t *testing.T) {
	var calls []string
	ctx := WithHook(context.Background(), "p", func() { calls = append(calls, "outer") })
	inner := WithHook(ctx, "p", func() { calls = append(calls, "inner") })
	other := WithHook(context.Background(), "q", func() { calls = append(calls, "other") })

	derived, cancel := context.WithCancel(context.WithoutCancel(inner))
	defer cancel()
	HitContext(derived, "p")
	HitContext(context.Background(), "p")
	HitContext(other, "p")
	HitContext(ctx, "q")
	if want := []string{"inner", "outer"}; len(calls) != 2 || calls[0] != want[0] || calls[1] != want[1] {
		t.Fatalf("hooks ran %v, want %v", calls, want)
	}
}

func BenchmarkHitContextUnarmed(b *testing.B) {
	ctx := context.Background()
	for b.Loop() {
		HitContext(ctx, "relay.lease-locked")
	}
}
