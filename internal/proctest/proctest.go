// Package proctest runs txbox commands as real OS processes in tests, so crash tests can kill
// them with SIGKILL, pause them with SIGSTOP and restart them.
//
// The binaries it builds are test binaries: they are built with the failpoint build tag
// (failpoint.BuildTag), so TXBOX_FAILPOINTS in their environment kills or stops them at a named
// point. BuildShipped builds a binary as a user's `go build` does, without it.
package proctest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/txbox/txbox/internal/failpoint"
)

var (
	buildMu sync.Mutex
	built   = map[string]string{} // package and tags → binary
)

// Binary builds cmd/txbox once per test binary and returns its path.
func Binary(t testing.TB) string {
	t.Helper()
	return Build(t, "./cmd/txbox")
}

// Build builds the main package pkg (a path from the module root, such as "./cmd/txbox") with the
// failpoint build tag, once per test binary, and returns the path of the executable.
func Build(t testing.TB, pkg string) string {
	t.Helper()
	return build(t, pkg, failpoint.BuildTag)
}

// BuildShipped builds the main package pkg as users build it, without the failpoint build tag, once
// per test binary, and returns the path of the executable.
func BuildShipped(t testing.TB, pkg string) string {
	t.Helper()
	return build(t, pkg, "")
}

func build(t testing.TB, pkg, tags string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	key := pkg + " tags=" + tags
	if bin, ok := built[key]; ok {
		return bin
	}
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..")
	dir, err := os.MkdirTemp("", "txbox-bin-")
	if err != nil {
		t.Fatalf("proctest: %v", err)
	}
	bin := filepath.Join(dir, filepath.Base(pkg))
	// -tags= replaces, rather than adds to, any tags GOFLAGS sets: a shipped build is tag-free.
	cmd := exec.Command("go", "build", "-tags="+tags, "-o", bin, pkg)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("proctest: go build -tags=%q %s: %v\n%s", tags, pkg, err, out)
	}
	built[key] = bin
	return bin
}

// Proc is a running txbox process.
type Proc struct {
	t    testing.TB
	cmd  *exec.Cmd
	out  *Buffer
	done chan struct{}
	err  error
}

// Start runs the txbox binary (Binary) with args and extra environment variables; the process is
// killed when the test ends, and its output is logged if the test failed.
func Start(t testing.TB, env []string, args ...string) *Proc {
	t.Helper()
	return StartProgram(t, Binary(t), env, args...)
}

// StartProgram is Start for the executable bin, built with Build or BuildShipped.
func StartProgram(t testing.TB, bin string, env []string, args ...string) *Proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	out := &Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("proctest: start %v: %v", args, err)
	}
	p := &Proc{t: t, cmd: cmd, out: out, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
		_ = p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("output of %s %v:\n%s", filepath.Base(bin), args, out.String())
		}
	})
	return p
}

// Signal sends sig to the process.
func (p *Proc) Signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("proctest: signal %v: %v", sig, err)
	}
}

// Wait waits for the process to exit, at most timeout, and returns its exit status: -1 when it was
// killed by a signal.
func (p *Proc) Wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.t.Fatalf("proctest: process did not exit within %s; output:\n%s", timeout, p.out.String())
	}
	return p.cmd.ProcessState.ExitCode()
}

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Output returns what the process wrote so far.
func (p *Proc) Output() string { return p.out.String() }

// Buffer is a bytes.Buffer safe for concurrent writers, for capturing a process's or a logger's
// output.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
