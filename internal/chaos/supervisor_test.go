package chaos_test

import (
	"bytes"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/txbox/txbox/internal/failpoint"
	"github.com/txbox/txbox/internal/proctest"
)

// consumerBinary builds cmd/txbox-consumer once per test binary and returns its path.
func consumerBinary(t testing.TB) string {
	return proctest.Build(t, "./internal/chaos/cmd/txbox-consumer")
}

// restartDelay is how long the supervisor waits before restarting a dead process, like systemd's
// RestartSec.
const restartDelay = 50 * time.Millisecond

// fault is what one incarnation of a program arms.
type fault struct {
	spec   string        // TXBOX_FAILPOINTS; "" arms nothing
	resume time.Duration // for a "stop" failpoint: how long the process stays stopped
}

// program is an OS process under a supervisor: whenever it dies it is started again, until stop.
// Each incarnation may arm a failpoint (TXBOX_FAILPOINTS), taken in turn from faults; once calm,
// incarnations arm none. A process that stops itself at a failpoint is continued after the fault's
// resume time.
type program struct {
	name   string
	path   string
	args   []string
	env    []string
	faults []fault
	out    *tailBuffer
	begun  time.Time

	mu       sync.Mutex
	cmd      *exec.Cmd // the running incarnation; nil between incarnations
	fault    fault     // armed in the running incarnation
	killed   bool      // the running incarnation was sent SIGKILL by the test
	calm     bool
	stopping bool
	stats    programStats

	stopCh chan struct{}
	done   chan struct{}
}

type programStats struct {
	starts     int
	kills      int            // SIGKILLs the test sent
	pauses     int            // SIGSTOPs the test sent
	failpoints map[string]int // deaths at an armed failpoint, by failpoint name
	stops      map[string]int // stops at an armed failpoint, by failpoint name
	crashes    int            // SIGKILLs nobody sent, with no failpoint armed: the process killed itself
	unexpected []string       // any other exit before stop, and exits that were not clean on stop
}

// supervise starts the program and keeps it running until the test ends or stop is called.
func supervise(t *testing.T, name, path string, args, env []string, faults []fault) *program {
	t.Helper()
	p := &program{
		name: name, path: path, args: args, env: env, faults: faults,
		out: &tailBuffer{limit: 256 << 10}, begun: time.Now(),
		stats:  programStats{failpoints: map[string]int{}, stops: map[string]int{}},
		stopCh: make(chan struct{}), done: make(chan struct{}),
	}
	go p.loop()
	t.Cleanup(func() {
		p.stop(10 * time.Second)
		if t.Failed() || os.Getenv("CHAOS_DUMP") != "" {
			t.Logf("output of %s (last %d KiB):\n%s", name, p.out.limit>>10, p.out.String())
		}
	})
	return p
}

func (p *program) loop() {
	defer close(p.done)
	for {
		p.mu.Lock()
		if p.stopping {
			p.mu.Unlock()
			return
		}
		var f fault
		if !p.calm && p.stats.starts < len(p.faults) {
			f = p.faults[p.stats.starts]
		}
		spec := f.spec
		cmd := exec.Command(p.path, p.args...)
		cmd.Env = append(os.Environ(), p.env...)
		cmd.Env = append(cmd.Env, failpoint.EnvVar+"="+spec)
		out := &lineWriter{to: p.out, line: p.watch(cmd)}
		cmd.Stdout, cmd.Stderr = out, out
		fmt.Fprintf(p.out, "=== %s: incarnation %d at %s, %s=%q\n", p.name, p.stats.starts+1, p.since(), failpoint.EnvVar, spec)
		if err := cmd.Start(); err != nil {
			p.stats.unexpected = append(p.stats.unexpected, fmt.Sprintf("start: %v", err))
			p.mu.Unlock()
			return
		}
		p.cmd, p.fault, p.killed = cmd, f, false
		p.stats.starts++
		p.mu.Unlock()

		_ = cmd.Wait()

		p.mu.Lock()
		p.cmd = nil
		ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
		sigkill := ws.Signaled() && ws.Signal() == syscall.SIGKILL
		switch {
		case sigkill && p.killed:
		case sigkill && spec != "" && !strings.Contains(spec, "="+failpoint.Stop):
			p.stats.failpoints[failpointName(spec)]++
		case sigkill:
			p.stats.crashes++
		case p.stopping && (ws.ExitStatus() == 0 || ws.Signaled() && ws.Signal() == syscall.SIGTERM):
			// Stopped as asked (a SIGTERM can beat the process's signal handler at start-up).
		default:
			p.stats.unexpected = append(p.stats.unexpected, fmt.Sprintf("incarnation %d (%s=%q) ended at %s: %s",
				p.stats.starts, failpoint.EnvVar, spec, p.since(), cmd.ProcessState))
		}
		fmt.Fprintf(p.out, "=== %s: incarnation %d ended at %s: %s\n", p.name, p.stats.starts, p.since(), cmd.ProcessState)
		stopping := p.stopping
		p.mu.Unlock()
		if stopping {
			return
		}
		select {
		case <-time.After(restartDelay):
		case <-p.stopCh:
			return
		}
	}
}

// watch returns the handler of the output lines of the incarnation cmd: it continues the process
// after a stop at a failpoint, which the failpoint announces on stderr before stopping.
func (p *program) watch(cmd *exec.Cmd) func(string) {
	return func(line string) {
		if !strings.HasPrefix(line, "txbox failpoint: ") || !strings.HasSuffix(line, ": stopping") {
			return
		}
		p.mu.Lock()
		resume := p.fault.resume
		if p.cmd == cmd {
			p.stats.stops[failpointName(p.fault.spec)]++
		}
		p.mu.Unlock()
		fmt.Fprintf(p.out, "=== %s: stopped at a failpoint at %s; SIGCONT in %s\n", p.name, p.since(), resume)
		go func() {
			select {
			case <-time.After(resume):
			case <-p.stopCh:
			}
			_ = cmd.Process.Signal(syscall.SIGCONT) // Harmless if it died meanwhile: os.Process knows.
		}()
	}
}

// failpointName is the name of the failpoint that spec arms.
func failpointName(spec string) string {
	name, _, _ := strings.Cut(spec, "@")
	name, _, _ = strings.Cut(name, "=")
	return name
}

func (p *program) since() time.Duration { return time.Since(p.begun).Round(time.Millisecond) }

// kill sends SIGKILL to the running incarnation, if any.
func (p *program) kill() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.stopping {
		return false
	}
	p.killed = true
	p.stats.kills++
	fmt.Fprintf(p.out, "=== %s: SIGKILL at %s\n", p.name, p.since())
	_ = p.cmd.Process.Kill()
	return true
}

// pause stops the running incarnation with SIGSTOP for d, then continues it: a process frozen by
// a long GC pause, a VM migration or a debugger, which wakes up unaware of the time that passed.
func (p *program) pause(d time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.stopping {
		return false
	}
	proc := p.cmd.Process
	if proc.Signal(syscall.SIGSTOP) != nil {
		return false
	}
	p.stats.pauses++
	fmt.Fprintf(p.out, "=== %s: SIGSTOP for %s at %s\n", p.name, d, p.since())
	go func() {
		select {
		case <-time.After(d):
		case <-p.stopCh:
		}
		_ = proc.Signal(syscall.SIGCONT) // Harmless if it died meanwhile: os.Process knows.
	}()
	return true
}

// calmDown makes every later incarnation start without a failpoint.
func (p *program) calmDown() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calm = true
}

// stop ends supervision: SIGTERM to the running incarnation, SIGKILL if it has not exited within
// timeout. It is safe to call more than once.
func (p *program) stop(timeout time.Duration) {
	p.mu.Lock()
	if p.stopping {
		p.mu.Unlock()
		<-p.done
		return
	}
	p.stopping = true
	close(p.stopCh)
	if p.cmd != nil {
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	p.mu.Unlock()
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.mu.Lock()
		p.stats.unexpected = append(p.stats.unexpected, fmt.Sprintf("did not stop within %s of SIGTERM", timeout))
		if p.cmd != nil {
			_ = p.cmd.Process.Kill()
		}
		p.mu.Unlock()
		<-p.done
	}
}

// snapshot returns a copy of the statistics.
func (p *program) snapshot() programStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.failpoints = maps.Clone(p.stats.failpoints)
	s.stops = maps.Clone(p.stats.stops)
	s.unexpected = append([]string(nil), p.stats.unexpected...)
	return s
}

func (s programStats) String() string {
	return fmt.Sprintf("%d starts, %d SIGKILLs sent, %d pauses, failpoint deaths %v, failpoint stops %v, %d self-kills",
		s.starts, s.kills, s.pauses, s.failpoints, s.stops, s.crashes)
}

// lineWriter passes what it is written to on, and each complete line to line.
type lineWriter struct {
	to      io.Writer
	line    func(string)
	mu      sync.Mutex
	partial []byte
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.partial = append(w.partial, p...)
	for {
		i := bytes.IndexByte(w.partial, '\n')
		if i < 0 {
			break
		}
		w.line(string(w.partial[:i]))
		w.partial = w.partial[i+1:]
	}
	return w.to.Write(p)
}

// tailBuffer keeps the last limit bytes written to it.
type tailBuffer struct {
	mu    sync.Mutex
	limit int
	buf   []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if len(b.buf) > 2*b.limit {
		b.buf = append([]byte(nil), b.buf[len(b.buf)-b.limit:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.buf) > b.limit {
		return string(b.buf[len(b.buf)-b.limit:])
	}
	return string(b.buf)
}
