package main

import (
	"context"
	"io"
)

// invoke runs txbox in process with exactly the environment variables in env.
func invoke(ctx context.Context, args []string, env map[string]string, stdout, stderr io.Writer) int {
	return run(ctx, args, func(k string) (string, bool) { v, ok := env[k]; return v, ok }, stdout, stderr)
}
