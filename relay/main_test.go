package relay_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/txbox/txbox/internal/pgtest"
)

func TestMain(m *testing.M) {
	// The test binary doubles as the consumer process that TestCallSurvivesCrashes kills.
	if spec := os.Getenv(helperEnv); spec != "" {
		fmt.Fprintln(os.Stderr, runHelperConsumer(spec))
		os.Exit(1)
	}
	pgtest.Main(m)
}
