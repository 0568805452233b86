package main

import "github.com/txbox/txbox/internal/visible"

// sanitize makes stored text safe to print on an operator's terminal: control characters, Unicode
// format characters and invalid UTF-8 become visible escapes (\x1b, \u202e), so a message cannot
// rewrite the screen or disguise itself. Newlines are kept for multi-line fields and escaped in
// table cells. --json output is exact and needs none of this.
func sanitize(s string, keepNewlines bool) string { return visible.Escape(s, keepNewlines) }

// cell is sanitize for one table cell or one-line field.
func cell(s string) string { return sanitize(s, false) }
