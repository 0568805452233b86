// Command txbox applies txbox's migrations and runs the relay.
//
//	txbox migrate up|down|status   apply, roll back or show the schema migrations
//	txbox relay                    publish outbox rows to Kafka until SIGINT/SIGTERM
//
// Every flag falls back to an environment variable; `txbox <command> --help` lists them.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/txbox/txbox/internal/sqlname"
)

// command is one subcommand: its flags are registered on fs, and run does the work.
type command struct {
	name, summary string
	run           func(ctx context.Context, args []string, stdout io.Writer) error
}

var commands = []command{
	{"migrate", "apply, roll back or show txbox's schema migrations", runMigrate},
	{"relay", "publish outbox rows to Kafka (runs until SIGINT or SIGTERM)", runRelay},
	{"dlq", "list, show, redrive (paced) or discard dead letters", runDLQ},
	{"retention", "delete inbox rows, attempt counters and call results txbox no longer needs", runRetention},
	{"status", "show the dead-letter depth and the size of txbox's tables", runStatus},
}

// errUsage marks an error in how txbox was called: it exits with status 2, not 1.
var errUsage = errors.New("usage")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil || errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage):
		fmt.Fprintln(os.Stderr, "txbox:", err)
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "txbox:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	slog.SetDefault(slog.New(slog.NewTextHandler(stderr, nil)))
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return fmt.Errorf("%w: no command given", errUsage)
		}
		return nil
	}
	for _, c := range commands {
		if c.name == args[0] {
			return c.run(ctx, args[1:], stdout)
		}
	}
	usage(stderr)
	return fmt.Errorf("%w: unknown command %q", errUsage, args[0])
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "Usage: txbox <command> [flags]\n\nCommands:")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nRun 'txbox <command> --help' for its flags.")
}

// flags is a FlagSet whose flags can fall back to environment variables.
type flags struct {
	*flag.FlagSet
	env    map[string]string // flag name → environment variable
	envErr error             // the first environment variable that did not parse
}

func newFlags(name, usageLine string) *flags {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	f := &flags{FlagSet: fs, env: map[string]string{}}
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: txbox %s\n\nFlags:\n", usageLine)
		fs.PrintDefaults()
	}
	return f
}

// stringEnv defines a string flag whose default comes from envVar when that is set.
func (f *flags) stringEnv(p *string, name, envVar, def, usage string) {
	if v := os.Getenv(envVar); v != "" {
		def = v
	}
	f.env[name] = envVar
	f.StringVar(p, name, def, usage+" (env "+envVar+")")
}

// database defines --database-url and --schema, which every command that talks to PostgreSQL has.
func (f *flags) database(dsn, schema *string) {
	f.stringEnv(dsn, "database-url", "TXBOX_DATABASE_URL", "", "PostgreSQL connection string (the password may come from PGPASSWORD)")
	f.stringEnv(schema, "schema", "TXBOX_SCHEMA", sqlname.DefaultSchema, "schema holding txbox's tables (migrate up creates it if missing)")
}

// varEnv defines a flag of any type whose default comes from envVar when that is set.
func (f *flags) varEnv(v flag.Value, name, envVar, usage string) {
	if s := os.Getenv(envVar); s != "" {
		if err := v.Set(s); err != nil && f.envErr == nil {
			f.envErr = fmt.Errorf("%w: %s=%q: %w", errUsage, envVar, s, err)
		}
	}
	f.env[name] = envVar
	f.Var(v, name, usage+" (env "+envVar+")")
}

// parse parses args; a parse error is a usage error.
func (f *flags) parse(args []string) error {
	if f.envErr != nil {
		return f.envErr
	}
	if err := f.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	return nil
}

// required reports a missing setting by its flag and its environment variable.
func (f *flags) required(name, value string) error {
	if value != "" {
		return nil
	}
	return fmt.Errorf("%w: --%s is required (or set %s)", errUsage, name, f.env[name])
}
