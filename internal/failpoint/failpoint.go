// Package failpoint interrupts txbox at named points, for tests that must stop a relay or a
// consumer at an exact step (after the broker acked, before the row was marked done, between the
// lease check and the write, say).
//
// # Real processes, in test builds only
//
// A binary built with the build tag txbox_failpoints (BuildTag; internal/proctest builds the
// binaries of the crash tests with it) reads the points once from the environment variable
// TXBOX_FAILPOINTS, a comma-separated list of items "name[=action][@N]":
//
//   - action "kill" (the default) kills the process with SIGKILL, exactly as `kill -9` would;
//   - action "stop" stops it with SIGSTOP, as a long GC pause, a VM freeze or `kill -STOP` would.
//     The process writes "txbox failpoint: <name>: stopping" to stderr first, and carries on from
//     the point when it gets SIGCONT;
//   - "@N" acts on the N-th hit of the point only (default: the first).
//
// For example TXBOX_FAILPOINTS=kafka.before-commit=stop@3,relay.after-publish@2.
//
// A binary built without the tag — `go build`, `go install`, a service linking txbox — contains
// neither the code that reads TXBOX_FAILPOINTS nor the code that kills or stops the process: a
// stray environment variable must never be able to take a production relay down.
//
// # In-process hooks
//
// A test running txbox in its own process attaches a function to a point with WithHook; the
// function runs at every hit of the point by code running under the returned context (or one
// derived from it), and may block to hold that code at the point. Hooks are scoped to a context,
// not global, so parallel tests cannot trip over each other's hooks.
//
// Hooks are compiled into every build, because the tests that use them are the ordinary `go test`
// of the library's packages. They cannot be reached from outside: this package is internal, so
// only txbox's own code can call WithHook, none of its non-test code does (internal/depgraph's
// TestOnlyTestsAttachFailpointHooks checks every file), and nothing from the environment,
// configuration or input turns one on. Without a hook the context is not even looked into.
//
// Unarmed, HitContext costs an atomic load (and, in test builds, a nil check).
package failpoint

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
)

// BuildTag is the build tag that compiles the TXBOX_FAILPOINTS actions into a binary.
const BuildTag = "txbox_failpoints"

// EnvVar names the environment variable that arms failpoints in binaries built with BuildTag.
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

// hooked is set once any hook was attached in this process, so that HitContext only looks into
// contexts in processes (tests) that use hooks.
var hooked atomic.Bool

// parse reads an EnvVar value. It is compiled into every build, so its tests and fuzz target run
// in the ordinary test suite, but only binaries built with BuildTag ever call it.
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

// HitContext marks the point name: in binaries built with BuildTag it first takes the action
// EnvVar arms for name, if this is the armed hit; then it runs the hooks that ctx carries for name.
func HitContext(ctx context.Context, name string) {
	act(name)
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
