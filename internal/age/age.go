// Package age reads and prints the ages and durations operators type and see, the same way in the
// txbox CLI and in the console: 90s, 15m, 36h, 7d, 1d12h.
package age

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Max bounds every age: far beyond any retention that makes sense, far below where time.Duration
// overflows (about 106751 days).
const Max = 3650 * 24 * time.Hour

// ErrSyntax is returned by Parse for text that is not an age from 0 to Max.
var ErrSyntax = errors.New("not a duration such as 90m, 36h, 7d or 1d12h")

// Parse parses a Go duration, or whole days followed by a Go duration: 7d, 1d12h. It refuses what
// is negative or over Max instead of wrapping around.
func Parse(s string) (time.Duration, error) {
	var days time.Duration
	if i := strings.IndexByte(s, 'd'); i > 0 {
		n, err := strconv.Atoi(s[:i])
		if err != nil || n < 0 || n > int(Max/(24*time.Hour)) {
			return 0, ErrSyntax
		}
		days, s = time.Duration(n)*24*time.Hour, s[i+1:]
		if s == "" {
			s = "0s"
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 || d > Max || d+days > Max {
		return 0, ErrSyntax
	}
	return d + days, nil
}

// Format prints an age compactly: 45s, 12m, 3h5m, 2d4h. A negative age prints as 0s.
func Format(d time.Duration) string {
	d = max(d, 0).Round(time.Second)
	switch {
	case d < time.Minute:
		return d.String()
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh%dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%dh", int(d.Hours())/24, int(d.Hours())%24)
}
