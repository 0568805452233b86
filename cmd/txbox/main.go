// Command txbox applies txbox's migrations, runs the relay and looks after dead letters.
//
//	txbox migrate up|down|status   apply, roll back or show the schema migrations
//	txbox relay                    publish outbox rows to Kafka until SIGINT/SIGTERM
//	txbox outbox list|show|bury     pending rows per shard; move a stuck row to the DLQ
//	txbox dlq list|show|redrive|discard
//	txbox retention                delete rows txbox no longer needs
//	txbox status [--json]          backlog, leases, relays, dead letters, dedup rate, call failures
//	txbox console                  the operator console, a web UI on loopback
//	txbox version | completion bash|zsh|fish
//
// Flags may come anywhere after the command; every setting falls back to a TXBOX_* environment
// variable (`txbox <command> --help` lists them). A value that cannot be used is a usage error
// naming the flag and its variable, with exit status 2, before anything is changed.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.LookupEnv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// app is one invocation of txbox: its environment, its outputs and its logger.
type app struct {
	lookupEnv      func(string) (string, bool)
	stdout, stderr io.Writer
	log            *slog.Logger

	logLevel, logFormat string
}

// run runs txbox with args and returns its exit status: 0, 1 for a failure, 2 for a usage error.
// Errors go to stderr, sanitised, after "txbox: ".
func run(ctx context.Context, args []string, lookupEnv func(string) (string, bool), stdout, stderr io.Writer) int {
	a := &app{lookupEnv: lookupEnv, stdout: stdout, stderr: stderr, log: slog.New(slog.NewTextHandler(stderr, nil))}
	root := a.rootCommand()
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return 0
	}
	fmt.Fprintf(stderr, "txbox: %s\n", sanitize(err.Error(), true))
	if errors.Is(err, errUsage) {
		fmt.Fprintf(stderr, "Run '%s --help' for usage.\n", cmd.CommandPath())
		return 2
	}
	return 1
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "txbox",
		Short: "Effectively-once messaging on PostgreSQL: migrations, the relay, dead letters and cleanup",
		Long: "txbox applies its schema migrations, runs the relay that publishes outbox rows to Kafka,\n" +
			"and inspects, redrives and discards dead letters.\n\n" +
			"Every setting falls back to the TXBOX_* environment variable named in its help.",
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			cmd.SetOut(a.stderr)
			_ = cmd.Help()
			return usagef("no command given")
		},
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.applyEnv(cmd.Flags()); err != nil {
				return err
			}
			return a.setUpLogging()
		},
	}
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	root.SetFlagErrorFunc(flagError)
	pf := root.PersistentFlags()
	a.logLevel, a.logFormat = "info", "text"
	a.setting(pf, text(&a.logLevel, oneOf("debug", "info", "warn", "error")), "log-level", "TXBOX_LOG_LEVEL", "least severe log level written: debug, info, warn or error")
	a.setting(pf, text(&a.logFormat, oneOf("text", "json")), "log-format", "TXBOX_LOG_FORMAT", "log format on standard error: text or json")
	root.AddCommand(
		a.migrateCommand(), a.relayCommand(), a.outboxCommand(), a.dlqCommand(), a.retentionCommand(), a.statusCommand(),
		a.versionCommand(),
		a.consoleCommand(),
	)
	return root
}

// usageArgs makes an argument check's error a usage error.
func usageArgs(check cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := check(cmd, args); err != nil {
			if slices.Contains(args, "true") || slices.Contains(args, "false") {
				// "--transactional false" is the flag, then a stray argument.
				return usagef("%v (a true/false flag takes its value after =, as in --transactional=false)", err)
			}
			return usagef("%v", err)
		}
		return nil
	}
}

// needsSubcommand is the RunE of a command that only groups others.
func needsSubcommand(cmd *cobra.Command, _ []string) error {
	var names []string
	for _, c := range cmd.Commands() {
		if c.IsAvailableCommand() {
			names = append(names, c.Name())
		}
	}
	return usagef("%s needs a subcommand: %s", cmd.CommandPath(), strings.Join(names, ", "))
}

func (a *app) setUpLogging() error {
	var level slog.Level
	if err := level.UnmarshalText([]byte(a.logLevel)); err != nil {
		return err // unreachable: the flag accepts only valid levels
	}
	opts := &slog.HandlerOptions{Level: level}
	if a.logFormat == "json" {
		a.log = slog.New(slog.NewJSONHandler(a.stderr, opts))
	} else {
		a.log = slog.New(slog.NewTextHandler(a.stderr, opts))
	}
	return nil
}

// logStart writes the one start line of a command: every flag's effective value, secrets
// redacted, plus what the command resolved itself (key, value pairs), which replaces the flag of
// the same name: a relay's --owner "" is logged as the owner it chose.
func (a *app) logStart(cmd *cobra.Command, resolved ...any) {
	names := map[string]bool{}
	for i := 0; i < len(resolved); i += 2 {
		if k, ok := resolved[i].(string); ok {
			names[k] = true
		}
	}
	var attrs []any
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if name := strings.ReplaceAll(f.Name, "-", "_"); f.Name != "help" && !names[name] {
			attrs = append(attrs, slog.String(name, display(f)))
		}
	})
	a.log.Info(cmd.CommandPath()+" starting", append(attrs, resolved...)...)
}

func (a *app) versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "print txbox's version, source revision and Go version",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(*cobra.Command, []string) error {
			info, ok := debug.ReadBuildInfo()
			if !ok {
				return errors.New("this binary carries no build information")
			}
			settings := map[string]string{}
			for _, s := range info.Settings {
				settings[s.Key] = s.Value
			}
			fmt.Fprintf(a.stdout, "txbox %s\n", info.Main.Version)
			if rev := settings["vcs.revision"]; rev != "" {
				if settings["vcs.modified"] == "true" {
					rev += " (modified)"
				}
				fmt.Fprintf(a.stdout, "revision %s %s\n", rev, settings["vcs.time"])
			}
			fmt.Fprintf(a.stdout, "built with %s\n", info.GoVersion)
			return nil
		},
	}
}
