package main

import "github.com/txbox/txbox/internal/visible"

// sanitize makes stored text safe to print on an operator's terminal: control characters, Unicode
// format characters and invalid UTF-8 become visible escapes (\x1b, \u202e), so a message cannot
// rewrite the screen or disguise itself. Newlines are kept for multi-line fields and escaped in
// table cells. --json output is exact and needs none of this.
func sanitize(s string, keepNewlines bool) string { return visible.Escape(s, keepNewlines) }

// cell is sanitize for one table cell or one-line field.
func cell(s string) string { return sanitize(s, false) }

// column is cell for a column of a table of stored text (topics, keys, consumers, reasons):
// shortened, so that one long value (a partition key of megabytes) does not widen every row. The
// show commands and --json print it whole.
func column(s string) string { return cell(truncate(s, columnWidth)) }

const columnWidth = 60
