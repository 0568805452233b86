// Package failpoint interrupts txbox at named points, for tests that must stop a relay or a
// consumer at an exact step (after the broker acked, before the row was marked done, between the
// lease check and the write, say).
//
// # Real processes
//
// The points are read once from the environment variable TXBOX_FAILPOINTS, a comma-separated list
// of items "name[=action][@N]":
//
//   - action "kill" (the default) kills the process with SIGKILL, exactly as `kill -9` would;
//   - action "stop" stops it with SIGSTOP, as a long GC pause, a VM freeze or `kill -STOP` would.
//     The process writes "txbox failpoint: <name>: stopping" to stderr first, and carries on from
//     the point when it gets SIGCONT;
//   - "@N" acts on the N-th hit of the point only (default: the first).
//
// For example TXBOX_FAILPOINTS=kafka.before-commit=stop@3,relay.after-publish@2.
//
// # In-process hooks
//
// A test running txbox in its own process attaches a function to a point with WithHook; the
// function runs at every hit of the point by code running under the returned context (or one
// derived from it), and may block to hold that code at the point. Hooks are scoped to a context,
// not global, so parallel tests cannot trip over each other's hooks.
//
// Unarmed (no TXBOX_FAILPOINTS, no hook ever attached) Hit and HitContext cost a nil check and an
// atomic load.
package failpoint

import (
	"context"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
)

// EnvVar names the environment variable that arms failpoints.
const EnvVar = "TXBOX_FAILPOINTS"

// Actions a failpoint armed through EnvVar takes.
const (
	Kill = "kill"
	Stop = "stop"
)

type point struct {
	nth    int
	action string
}

var (
	armed = parse(os.Getenv(EnvVar))
	mu    sync.Mutex
	hits  = map[string]int{}

	// hooked is set once any hook was attached in this process, so that HitContext only looks
	// into contexts in processes (tests) that use hooks.
	hooked atomic.Bool
)

func parse(spec string) map[string]point {
	if spec == "" {
		return nil
	}
	m := map[string]point{}
	for _, item := range strings.Split(spec, ",") {
		item = strings.TrimSpace(item)
		n := 1
		if at := strings.LastIndexByte(item, '@'); at >= 0 {
			if v, err := strconv.Atoi(item[at+1:]); err == nil && v >= 1 {
				n = v
			}
			item = item[:at]
		}
		name, action, _ := strings.Cut(item, "=")
		if action == "" {
			action = Kill
		}
		m[name] = point{nth: n, action: action}
	}
	return m
}

// Hit takes the action armed for name through EnvVar, if this is the armed hit.
func Hit(name string) {
	p, ok := armed[name]
	if !ok {
		return
	}
	mu.Lock()
	hits[name]++
	n := hits[name]
	mu.Unlock()
	if n != p.nth {
		return
	}
	switch p.action {
	case Stop:
		cont := make(chan os.Signal, 1)
		signal.Notify(cont, syscall.SIGCONT)
		defer signal.Stop(cont)
		_, _ = os.Stderr.WriteString("txbox failpoint: " + name + ": stopping\n")
		_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
		// The kernel stops the threads of a process one by one, and the thread that sent the
		// signal need not be the first: without this wait, the code after the point could run
		// before the process stops (a Kafka commit that should have been left open, say).
		<-cont
	default:
		// Nothing is flushed or deferred: that is the point.
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // SIGKILL is not delivered synchronously; never run past the point.
	}
}

// HitContext is Hit, and then runs the hooks that ctx carries for name.
func HitContext(ctx context.Context, name string) {
	if armed != nil {
		Hit(name)
	}
	if !hooked.Load() {
		return
	}
	for h, _ := ctx.Value(hookKey{}).(*hook); h != nil; h = h.parent {
		if h.name == name {
			h.fn()
		}
	}
}

type hookKey struct{}

type hook struct {
	name   string
	fn     func()
	parent *hook
}

// WithHook returns a context under which every HitContext(ctx, name) calls fn. Several hooks for
// one name all run, the most recently attached first.
func WithHook(ctx context.Context, name string, fn func()) context.Context {
	hooked.Store(true)
	parent, _ := ctx.Value(hookKey{}).(*hook)
	return context.WithValue(ctx, hookKey{}, &hook{name: name, fn: fn, parent: parent})
}
