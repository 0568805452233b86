package main

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// sanitize makes stored text safe to print on an operator's terminal: control characters
// (escape sequences, carriage returns, bells), Unicode format characters that reorder or hide text
// (bidi overrides, zero-width marks) and invalid UTF-8 are written as visible escapes (\x1b,
// \u202e), so a message cannot rewrite the screen or disguise itself. Newlines are kept for
// multi-line fields and escaped in table cells. --json output is exact and needs none of this.
func sanitize(s string, keepNewlines bool) string {
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

// cell is sanitize for one table cell or one-line field.
func cell(s string) string { return sanitize(s, false) }
