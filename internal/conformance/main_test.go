package conformance_test

import (
	"fmt"
	"net/http"
	"os"
	"testing"

	"github.com/txbox/txbox/internal/pgtest"
)

// restartArg makes the test binary the suite's RestartServiceCommand: run as
// `<test binary> restart-relay <url>`, it asks the test process that serves url to restart its relay
// and exits 0 once the new relay holds every shard.
const restartArg = "restart-relay"

func TestMain(m *testing.M) {
	if len(os.Args) == 3 && os.Args[1] == restartArg {
		os.Exit(requestRestart(os.Args[2]))
	}
	pgtest.Main(m)
}

func requestRestart(url string) int {
	resp, err := http.Post(url, "text/plain", nil)
	if err != nil {
		fmt.Fprintf(os.Stderr, "restart relay: %v\n", err)
		return 1
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		fmt.Fprintf(os.Stderr, "restart relay: %s\n", resp.Status)
		return 1
	}
	return 0
}
