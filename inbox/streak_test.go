package inbox

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// In an outage every delivery's bookkeeping fails: a streak says which failure to log (the first)
// and which success ends it, so the log holds two lines, not one per delivery.
func TestAStreakReportsItsFirstFailureAndItsRecovery(t *testing.T) {
	var s streak
	down := errors.New("connection refused")
	type report struct{ first, recovered bool }
	var got []report
	for _, err := range []error{nil, down, down, down, nil, nil, down, nil} {
		first, recovered := s.report(err)
		got = append(got, report{first, recovered})
	}
	require.Equal(t, []report{{}, {first: true}, {}, {}, {recovered: true}, {}, {first: true}, {recovered: true}}, got)
}
