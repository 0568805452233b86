package main

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/txbox/txbox/internal/age"
	"github.com/txbox/txbox/internal/sqlname"
)

// Flag annotations: how the one env fallback, the required check, the start line and the error
// messages learn about a flag, whatever its command.
const (
	annEnv      = "txbox_env"      // the environment variable the flag falls back to
	annSecret   = "txbox_secret"   // the value is never printed as is
	annRequired = "txbox_required" // the flag or its variable must be given
	annField    = "txbox_field"    // the library Config field the flag sets, for error messages
)

// errUsage marks an error in how txbox was called: it exits with status 2, not 1.
var errUsage = errors.New("usage")

// usageError is an error in how txbox was called.
type usageError struct{ msg string }

func (e *usageError) Error() string        { return e.msg }
func (e *usageError) Is(target error) bool { return target == errUsage }

func usagef(format string, args ...any) error {
	return &usageError{fmt.Sprintf(format, args...)}
}

// ref names a flag the way every message does: "--shards / TXBOX_SHARDS".
func ref(f *pflag.Flag) string {
	if env := annotation(f, annEnv); env != "" {
		return "--" + f.Name + " / " + env
	}
	return "--" + f.Name
}

// refOf is ref for a flag of cmd by name.
func refOf(cmd *cobra.Command, name string) string { return ref(cmd.Flags().Lookup(name)) }

func annotation(f *pflag.Flag, key string) string {
	if v := f.Annotations[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

func annotate(f *pflag.Flag, key, value string) {
	if f.Annotations == nil {
		f.Annotations = map[string][]string{}
	}
	f.Annotations[key] = []string{value}
}

// setting defines a flag that falls back to the environment variable env. Settings are what
// configures txbox (connection, tuning, logging); what selects or destroys data (dlq filters,
// --all, --force) has no variable on purpose, so a variable left in a shell cannot select it.
func (a *app) setting(fs *pflag.FlagSet, v pflag.Value, name, env, usage string) *pflag.Flag {
	f := fs.VarPF(v, name, "", usage)
	annotate(f, annEnv, env)
	// The variable's value is not shown: it may be a secret, and help must never print one.
	if a.getenv(env) != "" {
		f.Usage += " [$" + env + " is set]"
	} else {
		f.Usage += " [$" + env + "]"
	}
	return f
}

// getenv is the variable's value, "" when it is not set.
func (a *app) getenv(name string) string {
	v, _ := a.lookupEnv(name)
	return v
}

// applyEnv is the one env fallback: every flag not given on the command line takes its
// variable's value, through the same parsing and bounds as the flag. It then checks that required
// flags were given one way or the other.
func (a *app) applyEnv(fs *pflag.FlagSet) error {
	var errs []error
	fs.VisitAll(func(f *pflag.Flag) {
		env := annotation(f, annEnv)
		if env == "" || f.Changed {
			return
		}
		v, set := a.lookupEnv(env)
		switch {
		case !set:
		case v == "":
			// Most often a template that rendered nothing: taking the default would hide it.
			hint := "; unset the variable for the default"
			if annotation(f, annRequired) != "" {
				hint = ""
			}
			errs = append(errs, usagef("%s is set but empty%s", ref(f), hint))
		default:
			if err := f.Value.Set(v); err != nil {
				errs = append(errs, invalid(f, err))
				return
			}
			f.Changed = true
		}
	})
	fs.VisitAll(func(f *pflag.Flag) {
		if annotation(f, annRequired) != "" && !f.Changed {
			errs = append(errs, usagef("%s is required", ref(f)))
		}
	})
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// invalid is the usage error of a value a flag refused: "--shards / TXBOX_SHARDS must divide 256,
// got 7". The value itself appears only where its check put it, never for a secret.
func invalid(f *pflag.Flag, err error) error {
	return usagef("%s %v", ref(f), err)
}

// flagError turns pflag's parse errors into usage errors that name the flag and its variable.
func flagError(_ *cobra.Command, err error) error {
	var iv *pflag.InvalidValueError
	if errors.As(err, &iv) {
		return invalid(iv.GetFlag(), iv.Unwrap())
	}
	return usagef("%v", err)
}

// fieldNames maps the library Config fields the flags of cmd set to the flags, so that an error a
// library returns ("relay: Config.Shards is 8 but ...") names what the operator typed.
func fieldNames(cmd *cobra.Command, err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if field := annotation(f, annField); field != "" {
			msg = strings.ReplaceAll(msg, field, ref(f))
		}
	})
	if msg == err.Error() {
		return err
	}
	// The library's package prefix ("relay: ") would read as the subcommand's name once the
	// message names flags: "txbox: relay: --kafka-brokers ...".
	if pkg, rest, ok := strings.Cut(msg, ": "); ok && pkg == strings.ToLower(pkg) && !strings.ContainsAny(pkg, " -") {
		msg = rest
	}
	return &renamedError{msg: msg, err: err}
}

// renamedError is err with a message that names flags instead of Config fields.
type renamedError struct {
	msg string
	err error
}

func (e *renamedError) Error() string { return e.msg }
func (e *renamedError) Unwrap() error { return e.err }

// value is a flag value of type T: parse turns text into a T or says why it cannot, in words that
// follow the flag's name ("must be ..., got ...").
type value[T any] struct {
	p     *T
	typ   string
	parse func(string) (T, error)
	show  func(T) string
}

func (v *value[T]) Set(s string) error {
	x, err := v.parse(s)
	if err != nil {
		return err
	}
	*v.p = x
	return nil
}

func (v *value[T]) String() string {
	if v.p == nil {
		return ""
	}
	return v.show(*v.p)
}

func (v *value[T]) Type() string { return v.typ }

func intIn(p *int, lo, hi int) *value[int] {
	return &value[int]{p: p, typ: "int", show: strconv.Itoa, parse: func(s string) (int, error) {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < lo || n > hi {
			return 0, fmt.Errorf("must be a whole number from %d to %d, got %q", lo, hi, s)
		}
		return n, nil
	}}
}

func shardsValue(p *int, slots int) *value[int] {
	return &value[int]{p: p, typ: "int", show: strconv.Itoa, parse: func(s string) (int, error) {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 || n > slots || slots%n != 0 {
			return 0, fmt.Errorf("must divide %d (1, 2, 4, ... %d), got %s", slots, slots, s)
		}
		return n, nil
	}}
}

// maxAge bounds every duration (age.Max).
const maxAge = age.Max

// durationIn accepts Go durations and whole days ("90m", "36h", "7d", "1d12h") from lo to hi.
// A zero default is shown as nothing: the usage text says what leaving it out means.
func durationIn(p *time.Duration, lo, hi time.Duration) *value[time.Duration] {
	return &value[time.Duration]{p: p, typ: "duration", show: showDuration, parse: func(s string) (time.Duration, error) {
		d, err := parseAge(s)
		switch {
		case err != nil:
			return 0, fmt.Errorf("must be a duration from %s to %s, written like 90s, 15m, 36h or 7d, got %q", formatDuration(lo), formatDuration(hi), s)
		case d < lo || d > hi:
			return 0, fmt.Errorf("must be a duration from %s to %s, got %q", formatDuration(lo), formatDuration(hi), s)
		}
		return d, nil
	}}
}

func showDuration(d time.Duration) string {
	if d == 0 {
		return ""
	}
	return formatDuration(d)
}

// formatDuration prints a duration exactly, in the syntax the flags accept: 25ms, 10s, 23h59m, 15d.
func formatDuration(d time.Duration) string {
	const day = 24 * time.Hour
	var s string
	if d >= day {
		s = fmt.Sprintf("%dd", d/day)
		d %= day
		if d == 0 {
			return s
		}
	}
	t := d.String()
	if strings.HasSuffix(t, "m0s") {
		t = strings.TrimSuffix(t, "0s")
	}
	if strings.HasSuffix(t, "h0m") {
		t = strings.TrimSuffix(t, "0m")
	}
	return s + t
}

func floatIn(p *float64, lo, hi float64) *value[float64] {
	show := func(f float64) string {
		if f == 0 {
			return ""
		}
		return strconv.FormatFloat(f, 'g', -1, 64)
	}
	return &value[float64]{p: p, typ: "float", show: show, parse: func(s string) (float64, error) {
		f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f < lo || f > hi {
			return 0, fmt.Errorf("must be a number from %g to %g, got %q", lo, hi, s)
		}
		return f, nil
	}}
}

func boolValue(p *bool) *value[bool] {
	return &value[bool]{p: p, typ: "bool", show: strconv.FormatBool, parse: func(s string) (bool, error) {
		b, err := strconv.ParseBool(s)
		if err != nil {
			return false, fmt.Errorf("must be true or false, got %q", s)
		}
		return b, nil
	}}
}

// text is a string flag whose check says what is wrong with a value, or nil.
func text(p *string, check func(string) error) *value[string] {
	return &value[string]{p: p, typ: "string", show: func(s string) string { return s }, parse: func(s string) (string, error) {
		if err := check(s); err != nil {
			return "", err
		}
		return s, nil
	}}
}

func oneOf(choices ...string) func(string) error {
	return func(s string) error {
		for _, c := range choices {
			if s == c {
				return nil
			}
		}
		return fmt.Errorf("must be one of %s, got %q", strings.Join(choices, ", "), s)
	}
}

func nonEmpty(s string) error {
	if strings.TrimSpace(s) == "" {
		return errors.New("must not be empty")
	}
	return nil
}

func schemaName(s string) error {
	if s == "" {
		// sqlname takes "" for the default; given on the command line it is a mistake, not that.
		return fmt.Errorf("must not be empty (leave it out for %s)", sqlname.DefaultSchema)
	}
	if _, err := sqlname.Schema(s); err != nil {
		return fmt.Errorf("is not usable: %w", err)
	}
	return nil
}

// hostPort accepts "host:port".
func hostPort(s string) error {
	_, port, err := net.SplitHostPort(s)
	if err != nil || port == "" {
		return fmt.Errorf("must be host:port, got %q", s)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("must be host:port with a port number up to 65535, got %q", s)
	}
	return nil
}

// listenAddr is a host:port to listen on, or "off" (also "" given as a flag, --metrics-addr=) for
// none: an environment variable set to nothing is refused like any other (see applyEnv), so a
// deployment configured only through the environment turns the listener off by name.
func listenAddr(p *string) *value[string] {
	return &value[string]{p: p, typ: "string", show: func(s string) string { return cmp.Or(s, "off") }, parse: func(s string) (string, error) {
		if s == "" || s == "off" {
			return "", nil
		}
		if err := hostPort(s); err != nil {
			return "", fmt.Errorf(`%w (or "off" for no listener)`, err)
		}
		return s, nil
	}}
}

// list accepts comma-separated items, each passing check.
func list(check func(string) error) func(string) error {
	return func(s string) error {
		for item := range strings.SplitSeq(s, ",") {
			if strings.TrimSpace(item) == "" {
				return fmt.Errorf("must be a comma-separated list without empty items, got %q", s)
			}
			if err := check(strings.TrimSpace(item)); err != nil {
				return err
			}
		}
		return nil
	}
}

func splitList(s string) []string {
	if s == "" {
		return nil
	}
	items := strings.Split(s, ",")
	for i := range items {
		items[i] = strings.TrimSpace(items[i])
	}
	return items
}

func httpURL(s string) error {
	// A user or password is refused, and a value that may hold one is not quoted: the relay would
	// print it on its start line, and send none of it (the API key is the Authorization header).
	if strings.Contains(s, "@") {
		return errors.New("must be an http(s) URL without a user name or password (the value is not shown)")
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return fmt.Errorf("must be an http(s) URL, got %q", s)
	}
	return nil
}

// dsnValue is a PostgreSQL connection string: checked by pgx's parser, never shown. pgx's own
// parse errors quote the string with the password masked only on a best-effort basis, so none of
// their text is passed on.
func dsnValue(p *string) *value[string] {
	return &value[string]{p: p, typ: "string", show: func(string) string { return "" }, parse: func(s string) (string, error) {
		if s == "" {
			// pgx takes "" for libpq's defaults (a local socket, the OS user): never what was meant.
			return "", errors.New("must not be empty")
		}
		if _, err := pgconn.ParseConfig(s); err != nil {
			return "", errors.New("is not a valid PostgreSQL connection string (the value is not shown: it may hold a password)")
		}
		// The pool's own settings (pool_max_conns, ...) are read only by pgxpool: refused here, a
		// bad one is a usage error like any other, reported without the string.
		if _, err := pgxpool.ParseConfig(s); err != nil {
			return "", fmt.Errorf("is not a usable PostgreSQL connection string: %s (the value is not shown: it may hold a password)", dsnProblem(err))
		}
		return s, nil
	}}
}

// dsnProblem says why pgx refused a connection string, without the string. pgx's own message
// quotes it with its password masked only as far as pgx can recognise the password: spellings it
// does not (a keyword/value "password = secret", an escaped space in the value) were printed
// whole. Only pgxpool's reason is kept: what it says of its own pool_* setting.
func dsnProblem(err error) string {
	var pce *pgconn.ParseConfigError
	if !errors.As(err, &pce) {
		return "pgx refused it"
	}
	c := *pce
	c.ConnString = ""
	return strings.TrimPrefix(c.Error(), "cannot parse ``: ")
}

// redactDSN shows where a connection string points, without its password.
func redactDSN(dsn string) string {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return "(not a valid connection string)"
	}
	u := url.URL{Scheme: "postgres", User: url.User(cfg.User), Host: net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), Path: "/" + cfg.Database}
	return u.String()
}

// display is a flag's effective value for the start line: secrets redacted.
func display(f *pflag.Flag) string {
	if annotation(f, annSecret) != "" {
		// A secret's String is empty, so that nothing prints it by accident; read it directly.
		if v, ok := f.Value.(*value[string]); ok && *v.p != "" {
			return redactDSN(*v.p)
		}
		return ""
	}
	return f.Value.String()
}
