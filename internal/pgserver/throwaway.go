package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const (
	readyTimeout = 30 * time.Second
	stopTimeout  = 30 * time.Second
	// A port picked as free can be taken by someone else (another test
	// binary starting its own throwaway) before postgres binds it.
	startAttempts = 3
	// sun_path is 108 bytes on Linux; postgres refuses longer socket paths.
	maxSocketDirLen = 107 - len("/.s.PGSQL.65535")
)

// runAsUser is who initdb and postgres run as when we are root, because
// both refuse to run as root.
type runAsUser struct {
	name     string
	uid, gid uint32
}

// StartThrowaway initdb's a fresh cluster in a temp dir and starts it on a
// free 127.0.0.1 port with trust auth, regardless of what else is running.
// Stop removes it. logf is as for Discover.
func StartThrowaway(ctx context.Context, logf func(format string, args ...any)) (*Server, error) {
	logf = orNop(logf)
	began := time.Now()

	binDir, err := findBinDir()
	if err != nil {
		return nil, err
	}
	var runAs *runAsUser
	if os.Geteuid() == 0 {
		if runAs, err = unprivilegedUser(); err != nil {
			return nil, err
		}
	}

	dir, err := os.MkdirTemp(tempParent(runAs != nil), "txbox-pg-")
	if err != nil {
		return nil, fmt.Errorf("pgserver: temp dir: %w", err)
	}
	s := &Server{Throwaway: true, dir: dir, binDir: binDir, runAs: runAs, logf: logf}
	fail := func(err error) (*Server, error) {
		if stopErr := s.Stop(); stopErr != nil {
			err = fmt.Errorf("%w (cleanup: %v)", err, stopErr)
		}
		return nil, err
	}
	if runAs != nil {
		if err := os.Chown(dir, int(runAs.uid), int(runAs.gid)); err != nil {
			return fail(fmt.Errorf("pgserver: chown %s to %s: %w", dir, runAs.name, err))
		}
	}

	out, err := s.run(ctx, "initdb",
		"-D", s.dataDir(), "--username=postgres", "--auth=trust",
		"--encoding=UTF8", "--locale=C", "--no-sync")
	if err != nil {
		return fail(fmt.Errorf("pgserver: initdb (%s) failed: %w\n%s", binDir, err, tail(out, 2000)))
	}
	if err := s.writeConf(); err != nil {
		return fail(err)
	}

	var port int
	for attempt := 1; ; attempt++ {
		if port, err = freePort(); err != nil {
			return fail(err)
		}
		// A fresh log per attempt, so the bind check below and the tail in
		// the error are about this attempt only.
		_ = os.Remove(s.logPath())
		s.port = port
		out, err = s.start(ctx)
		if err == nil {
			break
		}
		logTail := s.logTail()
		if attempt < startAttempts && ctx.Err() == nil && strings.Contains(logTail, "could not bind") {
			logf("pgserver: port %d was taken, retrying", port)
			s.killPostmaster() // pg_ctl -w may give up on a postmaster that is still around
			continue
		}
		return fail(fmt.Errorf("pgserver: pg_ctl start (%s) failed: %w\n%s\nserver log tail:\n%s",
			binDir, err, tail(out, 1000), logTail))
	}

	s.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	// pg_ctl -w trusts postmaster.pid; only a real connection over TCP
	// proves the URL we hand out works.
	if err := waitReady(ctx, s.URL, readyTimeout); err != nil {
		return fail(fmt.Errorf("pgserver: throwaway server at %s not ready: %w\nserver log tail:\n%s",
			s.URL, err, s.logTail()))
	}
	logf("pgserver: started throwaway PostgreSQL from %s at %s (dir %s) in %v",
		binDir, s.URL, dir, time.Since(began).Round(time.Millisecond))
	return s, nil
}

// start starts the postmaster on s.port and waits until it accepts connections.
func (s *Server) start(ctx context.Context) ([]byte, error) {
	return s.run(ctx, "pg_ctl", "start", "-D", s.dataDir(), "-l", s.logPath(),
		"-w", "-t", strconv.Itoa(int(readyTimeout/time.Second)), "-s", "-o", "-p "+strconv.Itoa(s.port))
}

func (s *Server) dataDir() string { return filepath.Join(s.dir, "data") }
func (s *Server) logPath() string { return filepath.Join(s.dir, "postgres.log") }

func (s *Server) writeConf() error {
	// Appended settings override initdb's defaults. Durability is pointless
	// for a server whose files are deleted on Stop, and costs test time.
	conf := fmt.Sprintf(`
# added by txbox internal/pgserver for a throwaway test server
listen_addresses = '127.0.0.1'
unix_socket_directories = '%s'
max_connections = 300
fsync = off
synchronous_commit = off
full_page_writes = off
logging_collector = off
# containers often mount a small /dev/shm
dynamic_shared_memory_type = mmap
`, strings.ReplaceAll(s.dir, "'", "''"))
	f, err := os.OpenFile(filepath.Join(s.dataDir(), "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	if _, err := f.WriteString(conf); err != nil {
		f.Close()
		return fmt.Errorf("pgserver: %w", err)
	}
	return f.Close()
}

// run executes one of the server binaries as the unprivileged user, with an
// environment that cannot steer it elsewhere.
func (s *Server) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(s.binDir, name), args...)
	// root's cwd or HOME may not be readable by the unprivileged user, and
	// postgres complains when it cannot return to its cwd.
	cmd.Dir = s.dir
	cmd.Env = childEnv(s.dir)
	// The postmaster is daemonized by pg_ctl with its output sent to the log,
	// but should anything still hold our pipes, don't hang on it.
	cmd.WaitDelay = 5 * time.Second
	if s.runAs != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{
			Credential: &syscall.Credential{Uid: s.runAs.uid, Gid: s.runAs.gid},
		}
	}
	return cmd.CombinedOutput()
}

func childEnv(home string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		// PGDATA, PGPORT, PGHOST ... from the caller's shell must not leak
		// into the throwaway; locale vars could make initdb pick a locale
		// that does not exist here.
		if strings.HasPrefix(k, "PG") || strings.HasPrefix(k, "LC_") || k == "LANG" || k == "LANGUAGE" || k == "HOME" {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "HOME="+home, "LC_ALL=C")
}

func (s *Server) stopThrowaway() error {
	var errs []error
	if _, err := os.Stat(filepath.Join(s.dataDir(), "postmaster.pid")); err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), stopTimeout+10*time.Second)
		out, err := s.run(ctx, "pg_ctl", "stop", "-D", s.dataDir(), "-m", "fast", "-w",
			"-t", strconv.Itoa(int(stopTimeout/time.Second)), "-s")
		cancel()
		if err != nil {
			s.logf("pgserver: pg_ctl stop failed (%v: %s); killing the postmaster", err, bytes.TrimSpace(out))
			if kerr := s.killPostmaster(); kerr != nil {
				errs = append(errs, fmt.Errorf("pgserver: stop %s: pg_ctl: %v: %s; kill: %w", s.dir, err, bytes.TrimSpace(out), kerr))
			}
		}
	}
	if err := os.RemoveAll(s.dir); err != nil {
		errs = append(errs, fmt.Errorf("pgserver: remove %s: %w", s.dir, err))
	}
	if len(errs) == 0 && s.URL != "" {
		s.logf("pgserver: stopped throwaway server %s", s.URL)
	}
	return errors.Join(errs...)
}

// killPostmaster is the fallback when pg_ctl cannot stop the server: SIGQUIT
// (immediate shutdown, lets the postmaster take its children down), then
// SIGKILL.
func (s *Server) killPostmaster() error {
	b, err := os.ReadFile(filepath.Join(s.dataDir(), "postmaster.pid"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil || pid <= 1 {
		return fmt.Errorf("bad postmaster.pid %q", first)
	}
	_ = syscall.Kill(pid, syscall.SIGQUIT)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		if syscall.Kill(pid, 0) != nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return err
	}
	return nil
}

func (s *Server) logTail() string {
	b, err := os.ReadFile(s.logPath())
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return tail(b, 4000)
}

func tail(b []byte, n int) string {
	b = bytes.TrimSpace(b)
	if len(b) > n {
		b = b[len(b)-n:]
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			b = b[i+1:]
		}
		return "...\n" + string(b)
	}
	return string(b)
}

func waitReady(ctx context.Context, url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		err := Ping(ctx, url, 2*time.Second)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no answer within %v: %w", timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgserver: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// tempParent picks where the temp dir goes. Dropping privileges needs every
// ancestor to be searchable by the unprivileged user, and the socket path
// must fit in sun_path; /tmp satisfies both when TMPDIR does not.
func tempParent(dropping bool) string {
	p := os.TempDir()
	if len(p)+len("/txbox-pg-1234567890") > maxSocketDirLen {
		return "/tmp"
	}
	if dropping {
		for d := p; ; d = filepath.Dir(d) {
			fi, err := os.Stat(d)
			if err != nil || fi.Mode().Perm()&0o001 == 0 {
				return "/tmp"
			}
			if d == filepath.Dir(d) {
				break
			}
		}
	}
	return p
}

func unprivilegedUser() (*runAsUser, error) {
	var errs []string
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil {
			errs = append(errs, fmt.Sprintf("user %s has non-numeric uid/gid %s/%s", name, u.Uid, u.Gid))
			continue
		}
		return &runAsUser{name: name, uid: uint32(uid), gid: uint32(gid)}, nil
	}
	return nil, fmt.Errorf("pgserver: running as root, and initdb/postgres refuse root, but no unprivileged user to run them as: %s",
		strings.Join(errs, "; "))
}

// findBinDir returns the first directory holding a complete set of server
// binaries. pg_config alone is not enough: on Debian it can come from
// libpq-dev on a machine without the server.
func findBinDir() (string, error) {
	dirs := candidateBinDirs()
	for _, d := range dirs {
		if hasServerBinaries(d) {
			return d, nil
		}
	}
	looked := "none found"
	if len(dirs) > 0 {
		looked = strings.Join(dirs, ", ")
	}
	return "", fmt.Errorf("pgserver: no PostgreSQL server binaries (initdb, pg_ctl, postgres) found; looked in: pg_config --bindir, /usr/lib/postgresql/*/bin, PATH (%s)", looked)
}

func candidateBinDirs() []string {
	var dirs []string
	seen := map[string]bool{}
	add := func(d string) {
		if d == "" {
			return
		}
		d = filepath.Clean(d)
		if !seen[d] {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		add(strings.TrimSpace(string(out)))
	}
	versioned, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.SliceStable(versioned, func(i, j int) bool {
		return versionLess(versionFromBinDir(versioned[j]), versionFromBinDir(versioned[i]))
	})
	for _, d := range versioned {
		add(d)
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		add(filepath.Dir(p))
	}
	return dirs
}

func hasServerBinaries(dir string) bool {
	for _, name := range []string{"initdb", "pg_ctl", "postgres"} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil || fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
			return false
		}
	}
	return true
}

// clusterVersion guesses the version to name in pg_ctlcluster advice: the
// newest Debian cluster configured here, else the newest server binaries.
func clusterVersion() string {
	var vs []string
	confs, _ := filepath.Glob("/etc/postgresql/*/main")
	for _, c := range confs {
		vs = append(vs, filepath.Base(filepath.Dir(c)))
	}
	if len(vs) == 0 {
		for _, d := range candidateBinDirs() {
			if v := versionFromBinDir(d); v != "" {
				vs = append(vs, v)
			}
		}
	}
	if len(vs) == 0 {
		return "VERSION"
	}
	sort.Slice(vs, func(i, j int) bool { return versionLess(vs[j], vs[i]) })
	return vs[0]
}

// versionFromBinDir returns "15" for /usr/lib/postgresql/15/bin, else "".
func versionFromBinDir(dir string) string {
	if !strings.HasPrefix(dir, "/usr/lib/postgresql/") {
		return ""
	}
	return filepath.Base(filepath.Dir(dir))
}

// versionLess compares "9.6" < "15" numerically, component by component,
// so that version 10+ sorts above 9.x.
func versionLess(a, b string) bool {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) || i < len(bs); i++ {
		var x, y int
		if i < len(as) {
			x, _ = strconv.Atoi(as[i])
		}
		if i < len(bs) {
			y, _ = strconv.Atoi(bs[i])
		}
		if x != y {
			return x < y
		}
	}
	return a < b
}

// Restart shuts a throwaway server down, leaves it down for down, and starts it again on the same
// port, for tests of what clients do while their database goes away and comes back. mode is
// pg_ctl's shutdown mode: "fast" (sessions are ended, a checkpoint is written) or "immediate" (like
// a crash of the database processes: crash recovery runs on start). The throwaway runs with
// synchronous_commit = off, so an immediate restart loses the last transactions it reported
// committed, as a real crash would; a test that needs them kept sets synchronous_commit = on first.
// It returns once the server answers over TCP again.
func (s *Server) Restart(ctx context.Context, mode string, down time.Duration) error {
	if !s.Throwaway {
		return errors.New("pgserver: Restart is only for a throwaway server this process started")
	}
	if mode != "fast" && mode != "immediate" {
		return fmt.Errorf("pgserver: Restart mode %q: want fast or immediate", mode)
	}
	s.stopMu.Lock()
	defer s.stopMu.Unlock()
	if s.stopped {
		return errors.New("pgserver: Restart after Stop")
	}
	out, err := s.run(ctx, "pg_ctl", "stop", "-D", s.dataDir(), "-m", mode,
		"-w", "-t", strconv.Itoa(int(stopTimeout/time.Second)), "-s")
	if err != nil {
		return fmt.Errorf("pgserver: pg_ctl stop -m %s: %w\n%s\nserver log tail:\n%s", mode, err, tail(out, 1000), s.logTail())
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(down):
	}
	if out, err := s.start(ctx); err != nil {
		return fmt.Errorf("pgserver: pg_ctl start after stop -m %s: %w\n%s\nserver log tail:\n%s", mode, err, tail(out, 1000), s.logTail())
	}
	if err := waitReady(ctx, s.URL, readyTimeout); err != nil {
		return fmt.Errorf("pgserver: %s not ready after restart: %w\nserver log tail:\n%s", s.URL, err, s.logTail())
	}
	return nil
}
