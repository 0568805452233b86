//go:build txbox_failpoints

package failpoint

import (
	"os"
	"os/signal"
	"sync"
	"syscall"
)

var (
	armed = parse(os.Getenv(EnvVar))
	mu    sync.Mutex
	hits  = map[string]int{}
)

// act takes the action armed for name through EnvVar, if this is the armed hit.
func act(name string) {
	if armed == nil {
		return
	}
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
