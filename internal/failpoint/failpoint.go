// Package failpoint kills the process at named points, for crash tests that must stop a real
// process at an exact step (after the broker acked, before the row was marked done, say).
//
// The points to crash at are read once from the environment variable TXBOX_FAILPOINTS, a
// comma-separated list of names, each optionally suffixed with "@N" to crash on the N-th hit only
// (default: the first). Unset, Hit costs one map lookup on a nil map.
package failpoint

import (
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// EnvVar names the environment variable that arms failpoints.
const EnvVar = "TXBOX_FAILPOINTS"

var (
	armed = parse(os.Getenv(EnvVar))
	mu    sync.Mutex
	hits  = map[string]int{}
)

func parse(spec string) map[string]int {
	if spec == "" {
		return nil
	}
	m := map[string]int{}
	for _, item := range strings.Split(spec, ",") {
		name, nth, _ := strings.Cut(strings.TrimSpace(item), "@")
		n, err := strconv.Atoi(nth)
		if err != nil || n < 1 {
			n = 1
		}
		m[name] = n
	}
	return m
}

// Hit kills the process with SIGKILL, exactly as `kill -9` would, if name is armed and this is the
// armed hit. Nothing is flushed or deferred: that is the point.
func Hit(name string) {
	nth, ok := armed[name]
	if !ok {
		return
	}
	mu.Lock()
	hits[name]++
	n := hits[name]
	mu.Unlock()
	if n == nth {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // SIGKILL is not delivered synchronously; never run past the point.
	}
}
