package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/spf13/cobra"

	"github.com/txbox/txbox/console"
	"github.com/txbox/txbox/status"
)

// consoleTokenEnv holds the operator token. It has no flag on purpose: flags show in ps and shell
// history.
const consoleTokenEnv = "TXBOX_CONSOLE_TOKEN"

func (a *app) consoleCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "console",
		Short: "serve the operator console: backlog, leases, dead letters, redrive, bury, call results (until SIGINT or SIGTERM)",
		Long: "Serves a web console on --addr (loopback by default) showing the outbox backlog, relays and leases,\n" +
			"dead letters, the dedup hit rate and call failures, and letting a signed-in operator redrive and\n" +
			"discard dead letters and bury stuck outbox rows; every change is audited.\n\n" +
			"Changes need the operator token from " + consoleTokenEnv + " (at least 16 characters; it has no flag:\n" +
			"flags show in ps). Without it, or with --read-only, the console only shows.",
		Args: usageArgs(cobra.NoArgs),
	}
	d := a.databaseFlags(cmd)
	var (
		addr         = "127.0.0.1:9465"
		readOnly     bool
		allowedHosts string
		window       = status.DefaultWindow
		refresh      = console.DefaultRefresh
	)
	fs := cmd.Flags()
	a.setting(fs, text(&addr, hostPort), "addr", "TXBOX_CONSOLE_ADDR", "address the console listens on; anyone who reaches it can read messages")
	a.setting(fs, boolValue(&readOnly), "read-only", "TXBOX_CONSOLE_READ_ONLY", "refuse every change even when "+consoleTokenEnv+" is set").NoOptDefVal = "true"
	f := a.setting(fs, text(&allowedHosts, list(nonEmpty)), "allowed-hosts", "TXBOX_CONSOLE_ALLOWED_HOSTS",
		"comma-separated host names, besides localhost and IP addresses, that browsers may reach the console by (a proxy's name)")
	annotate(f, annField, "Config.AllowedHosts")
	a.setting(fs, durationIn(&window, time.Minute, 30*24*time.Hour), "window", "TXBOX_CONSOLE_WINDOW",
		"how far back the overview looks for the dedup hit rate and call failures")
	a.setting(fs, durationIn(&refresh, time.Second, time.Minute), "refresh", "TXBOX_CONSOLE_REFRESH", "how often the overview takes a new snapshot")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		pool, err := d.connect(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		srv, err := console.New(console.Config{
			DB: pool, Schema: d.schema, Token: a.getenv(consoleTokenEnv), ReadOnly: readOnly,
			AllowedHosts: splitList(allowedHosts), Window: window, Refresh: refresh, Logger: a.log,
		})
		if err != nil {
			return usagef("%s", fieldNames(cmd, consoleTokenError(err)))
		}
		defer srv.Close()
		if err := srv.Check(ctx); err != nil {
			return err
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("%s %s: %w", refOf(cmd, "addr"), addr, err)
		}
		mode := "read-only"
		switch {
		case srv.CanChange():
			mode = "operators sign in with " + consoleTokenEnv
		case !readOnly:
			mode = "read-only: " + consoleTokenEnv + " is not set"
		}
		a.logStart(cmd, "mode", mode)
		a.warnBeyondLoopback(ln, "the console listens beyond loopback: anyone who reaches it can read every message")
		a.log.Info("console listening", "url", "http://"+ln.Addr().String()+"/")
		hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
		served := make(chan error, 1)
		go func() { served <- hs.Serve(ln) }()
		select {
		case err := <-served:
			return err
		case <-ctx.Done():
		}
		stopCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := hs.Shutdown(stopCtx); err != nil {
			_ = hs.Close()
		}
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		a.log.Info("console stopped")
		return nil
	}
	return cmd
}

// consoleTokenError names the environment variable in an error about Config.Token.
func consoleTokenError(err error) error {
	if errors.Is(err, console.ErrTokenTooShort) {
		return fmt.Errorf("%s must be at least %d characters long (the value is not shown)", consoleTokenEnv, console.MinTokenLength)
	}
	return err
}
