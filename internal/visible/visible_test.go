package visible_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/txbox/txbox/internal/visible"
)

func TestEscape(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		in        string
		keepLines bool
		want      string
	}{
		{"plain <b>text</b> & \"quotes\"", false, "plain <b>text</b> & \"quotes\""},
		{"red \x1b[31malert\x1b[0m\a", false, `red \x1b[31malert\x1b[0m\x07`},
		{"a\nb\tc\r", false, `a\nb\tc\r`},
		{"a\nb\tc\r", true, "a\nb\tc\\r"},
		{"abc\u202edcba\u200b", false, `abc\u202edcba\u200b`},
		{"bad \xff utf8", false, `bad \xff utf8`},
		{"héllo ✓", false, "héllo ✓"},
	} {
		require.Equal(t, c.want, visible.Escape(c.in, c.keepLines), "%q", c.in)
	}
}
