package relay

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// An outage is logged once when it starts and once when it ends, also when its last failing shard
// ends without recovering (taken over by another relay, or the relay stopping): an error in the
// log is always followed by its end.
func TestAnOutageLogsItsEndWhenItsLastShardIsReleased(t *testing.T) {
	t.Parallel()
	for name, ends := range map[string]func(o *outage){
		"recovered": func(o *outage) { o.settle(1, 0); o.settle(2, 3) },
		"released":  func(o *outage) { o.settle(2, 3); o.settle(1, 0) },
	} {
		t.Run(name, func(t *testing.T) {
			var logs bytes.Buffer
			o := newOutage(slog.New(slog.NewTextHandler(&logs, nil)), "publishing")
			o.fail(1, errors.New("broker down"))
			o.fail(2, errors.New("broker down"))
			ends(o)
			require.NoError(t, o.err())
			require.Equal(t, 1, strings.Count(logs.String(), "level=ERROR"), logs.String())
			require.Equal(t, 1, strings.Count(logs.String(), "level=INFO"), "one line for the end:\n%s", logs.String())
		})
	}
}
