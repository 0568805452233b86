package dlq_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"

	"github.com/txbox/txbox/dlq"
)

// PaceFor is the rule txbox dlq redrive and the console share: a rate is required above
// MaxUnpacedRedrive letters; below, the redrive is unpaced and limited to the letters counted.
func TestPaceFor(t *testing.T) {
	t.Parallel()
	f := dlq.Filter{Consumer: "billing"}
	plan := func(n int) dlq.RedriveResult { return dlq.RedriveResult{Planned: n} }

	got, opts, err := dlq.PaceFor(f, plan(dlq.MaxUnpacedRedrive), dlq.RedriveOptions{BatchSize: 7})
	require.NoError(t, err)
	require.Equal(t, rate.Inf, opts.Rate)
	require.Equal(t, 7, opts.BatchSize)
	require.Equal(t, dlq.MaxUnpacedRedrive, got.Limit, "letters arriving meanwhile wait for a paced run")

	limited := f
	limited.Limit = 3
	got, _, err = dlq.PaceFor(limited, plan(3), dlq.RedriveOptions{})
	require.NoError(t, err)
	require.Equal(t, 3, got.Limit)

	_, _, err = dlq.PaceFor(f, plan(dlq.MaxUnpacedRedrive+1), dlq.RedriveOptions{})
	require.ErrorIs(t, err, dlq.ErrRateRequired)
	require.ErrorContains(t, err, "101 are selected")

	got, opts, err = dlq.PaceFor(f, plan(1_000_000), dlq.RedriveOptions{Rate: 50})
	require.NoError(t, err)
	require.Equal(t, rate.Limit(50), opts.Rate)
	require.Equal(t, f, got, "a paced redrive keeps its filter")
}
