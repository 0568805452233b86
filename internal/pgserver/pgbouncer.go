package pgserver

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// PgBouncer is a PgBouncer in transaction pooling mode in front of a PostgreSQL server, started
// by this process, for code that must work through a pooler that hands every transaction a
// server connection of its own choosing.
type PgBouncer struct {
	addr     string // host:port PgBouncer listens on
	dir      string
	cmd      *exec.Cmd
	exited   chan struct{}
	stopOnce sync.Once
	stopErr  error
}

// PgBouncerPoolSize is how many server connections the PgBouncer keeps per database and user:
// more than one, so consecutive transactions of one client can land on different connections.
const PgBouncerPoolSize = 2

// StartPgBouncer starts pgbouncer on a free 127.0.0.1 port in front of the server of upstream (a
// connection string whose user has trust access). It pools in transaction mode and resets every
// server connection after each transaction (server_reset_query_always), so that any session
// state — a SET, an advisory lock, a prepared statement — one transaction leaves behind is gone
// for the next, every time rather than only when the pool happens to switch connections. The
// process is killed when this one exits (Stop ends it sooner). It fails, saying how to install
// it, when pgbouncer is not on the machine.
func StartPgBouncer(ctx context.Context, upstream string, logf func(format string, args ...any)) (*PgBouncer, error) {
	logf = orNop(logf)
	bin, err := findPgBouncer()
	if err != nil {
		return nil, err
	}
	cfg, err := pgconn.ParseConfig(upstream)
	if err != nil {
		return nil, fmt.Errorf("pgserver: pgbouncer upstream: %w", err)
	}
	var runAs *runAsUser
	if os.Geteuid() == 0 { // pgbouncer refuses to run as root
		if runAs, err = unprivilegedUser(); err != nil {
			return nil, err
		}
	}
	dir, err := os.MkdirTemp(tempParent(runAs != nil), "txbox-pgbouncer-")
	if err != nil {
		return nil, fmt.Errorf("pgserver: temp dir: %w", err)
	}
	b := &PgBouncer{dir: dir, exited: make(chan struct{})}
	fail := func(err error) (*PgBouncer, error) {
		return nil, errors.Join(err, b.Stop())
	}
	if runAs != nil {
		if err := os.Chown(dir, int(runAs.uid), int(runAs.gid)); err != nil {
			return fail(fmt.Errorf("pgserver: chown %s to %s: %w", dir, runAs.name, err))
		}
	}
	port, err := freePort()
	if err != nil {
		return fail(err)
	}
	b.addr = "127.0.0.1:" + strconv.Itoa(port)
	upstreamDB := fmt.Sprintf("host=%s port=%d", cfg.Host, cfg.Port)
	if cfg.Password != "" {
		upstreamDB += " password=" + quoteIni(cfg.Password)
	}
	ini := fmt.Sprintf(`[databases]
* = %s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
default_pool_size = %d
max_client_conn = 200
server_reset_query = DISCARD ALL
server_reset_query_always = 1
ignore_startup_parameters = extra_float_digits
logfile = %s
`, upstreamDB, port, filepath.Join(dir, "users.txt"), PgBouncerPoolSize, b.logPath())
	users := fmt.Sprintf("%q \"\"\n", cfg.User)
	for name, content := range map[string]string{"pgbouncer.ini": ini, "users.txt": users} {
		// The upstream password, if any, is in the ini: readable by pgbouncer's user alone.
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			return fail(fmt.Errorf("pgserver: %w", err))
		}
		if runAs != nil {
			if err := os.Chown(path, int(runAs.uid), int(runAs.gid)); err != nil {
				return fail(fmt.Errorf("pgserver: chown %s to %s: %w", path, runAs.name, err))
			}
		}
	}

	b.cmd = exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	b.cmd.Dir = dir
	b.cmd.Env = childEnv(dir)
	// A test binary that is killed runs no cleanup: the kernel ends pgbouncer with it.
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if runAs != nil {
		b.cmd.SysProcAttr.Credential = &syscall.Credential{Uid: runAs.uid, Gid: runAs.gid}
	}
	if err := b.cmd.Start(); err != nil {
		return fail(fmt.Errorf("pgserver: start %s: %w", bin, err))
	}
	go func() {
		_ = b.cmd.Wait()
		close(b.exited)
	}()

	probe := b.URLFor(upstream)
	if err := waitReady(ctx, probe, readyTimeout); err != nil {
		return fail(fmt.Errorf("pgserver: pgbouncer at %s not ready: %w\npgbouncer log tail:\n%s", b.addr, err, b.logTail()))
	}
	logf("pgserver: started pgbouncer (transaction pooling, %d server connections) at %s in front of %s:%d",
		PgBouncerPoolSize, b.addr, cfg.Host, cfg.Port)
	return b, nil
}

// URLFor returns dbURL, a connection string to the upstream server, routed through PgBouncer:
// the same user, database and parameters, with pgx's default_query_exec_mode=exec unless dbURL
// chose a mode, since pgx's default prepares named statements that a transaction pooler
// cannot keep.
func (b *PgBouncer) URLFor(dbURL string) string {
	u, err := url.Parse(dbURL)
	if err != nil || u.Scheme == "" {
		// A keyword/value string: the later keywords win.
		routed := dbURL + " host=127.0.0.1 port=" + b.addr[strings.LastIndexByte(b.addr, ':')+1:]
		if !strings.Contains(dbURL, "default_query_exec_mode") {
			routed += " default_query_exec_mode=exec"
		}
		return routed
	}
	u.Host = b.addr
	q := u.Query()
	q.Del("host")
	q.Del("port")
	if q.Get("default_query_exec_mode") == "" {
		q.Set("default_query_exec_mode", "exec")
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// Stop ends pgbouncer and removes its files.
func (b *PgBouncer) Stop() error {
	if b == nil {
		return nil
	}
	b.stopOnce.Do(func() { b.stopErr = b.stop() })
	return b.stopErr
}

func (b *PgBouncer) stop() error {
	var errs []error
	if b.cmd != nil && b.cmd.Process != nil {
		_ = b.cmd.Process.Signal(syscall.SIGINT) // pgbouncer's immediate shutdown
		select {
		case <-b.exited:
		case <-time.After(10 * time.Second):
			if err := b.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
				errs = append(errs, fmt.Errorf("pgserver: kill pgbouncer: %w", err))
			}
			<-b.exited
		}
	}
	if err := os.RemoveAll(b.dir); err != nil {
		errs = append(errs, fmt.Errorf("pgserver: remove %s: %w", b.dir, err))
	}
	return errors.Join(errs...)
}

func (b *PgBouncer) logPath() string { return filepath.Join(b.dir, "pgbouncer.log") }

func (b *PgBouncer) logTail() string {
	out, err := os.ReadFile(b.logPath())
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return tail(out, 4000)
}

func findPgBouncer() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer", "/usr/local/bin/pgbouncer"} {
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
			return p, nil
		}
	}
	return "", errors.New("pgserver: pgbouncer not found in PATH or /usr/sbin: install it (apt-get install -y pgbouncer; .ci/run does) to run the tests that go through a transaction pooler")
}

// quoteIni quotes a value for a libpq-style connection string in pgbouncer.ini.
func quoteIni(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}
