// Package pgtext checks and repairs strings for PostgreSQL's text and jsonb types, which refuse
// NUL characters and invalid UTF-8. Message ids and metadata arrive as arbitrary bytes (Kafka headers
// are bytes), and a value the database refuses would make a message fail on every delivery.
package pgtext

import (
	"strings"
	"unicode/utf8"
)

// Valid reports whether PostgreSQL accepts s as text.
func Valid(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

// Sanitize returns s with invalid UTF-8 and NUL characters replaced by U+FFFD, for values that are
// only displayed (a dead letter's metadata, an error text), never matched.
func Sanitize(s string) string {
	if Valid(s) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}
