// Package visible makes stored text safe to show a person: on a terminal (the txbox CLI) and on a
// web page (the console). Control characters (escape sequences, carriage returns, bells), Unicode
// format characters that reorder or hide text (bidi overrides, zero-width marks) and invalid UTF-8
// are written as visible escapes (\x1b, \u202e), so a message cannot rewrite the screen, disguise
// itself, or hide part of what it says.
package visible

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Escape returns s with every character that could change how the rest is shown written as an
// escape. Newlines and tabs are kept when keepNewlines is set (multi-line fields) and escaped
// otherwise (table cells, one-line fields).
func Escape(s string, keepNewlines bool) string {
	clean := true
	for _, r := range s {
		if needsEscape(r, keepNewlines) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\t' && !keepNewlines:
			b.WriteString(`\t`)
		case r == '\n' && !keepNewlines:
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case needsEscape(r, keepNewlines):
			if r < 0x80 {
				fmt.Fprintf(&b, `\x%02x`, r)
			} else {
				fmt.Fprintf(&b, `\u%04x`, r)
			}
		default:
			b.WriteRune(r)
		}
		i += size
	}
	return b.String()
}

func needsEscape(r rune, keepNewlines bool) bool {
	switch {
	case r == utf8.RuneError:
		return true
	case r == '\n' || r == '\t':
		return !keepNewlines
	}
	return unicode.IsControl(r) || unicode.Is(unicode.Cf, r)
}
