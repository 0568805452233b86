package age_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/age"
)

func TestParseAndFormat(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{
		"90m": 90 * time.Minute, "36h": 36 * time.Hour, "7d": 7 * 24 * time.Hour, "1d12h": 36 * time.Hour, "0": 0, "3650d": age.Max,
	} {
		got, err := age.Parse(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "d", "xd", "1w", "-5m", "1d-48h", "-1d", "3651d", "87601h", "3650d1h"} {
		_, err := age.Parse(in)
		require.ErrorIs(t, err, age.ErrSyntax, in)
	}
	for d, want := range map[time.Duration]string{
		-time.Second: "0s", 45 * time.Second: "45s", 12 * time.Minute: "12m", 3*time.Hour + 5*time.Minute: "3h5m", 52 * time.Hour: "2d4h",
	} {
		require.Equal(t, want, age.Format(d))
	}
}
