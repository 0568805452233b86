// Package console is txbox's operator console: a small web UI, served by `txbox console`, for the
// people on call. It shows the outbox backlog, the relays and their leases, the dead letters, the
// dedup hit rate and recent call failures; it redrives and discards dead letters, buries stuck
// outbox rows and looks up call results for reconciliation.
//
// # What it changes, and how
//
// The console implements no operation of its own: it calls dlq.Admin (Redrive, Discard),
// relay.Admin (Bury, Backlog, List, Get, CallResults) and status.Read, so a redrive from the
// console is paced, dry-run and refuses call letters exactly as `txbox dlq redrive` does
// (dlq.PaceFor is the rule both apply).
//
// Every change is written to the audit table txbox_console_audit (who, what, target, when,
// result). A discard and a bury are audited in the same transaction as the change: both commit or
// neither. A redrive moves letters in many paced transactions, so its audit is a row written
// before the first letter moves and a row when it ends (done, stopped or failed); a redrive
// interrupted by a crash of the console has only the first. Server.Check refuses a console that
// can change things on a schema without the audit table (migration 00007).
//
// # Safety
//
//   - Read-only unless Config.Token is set; Config.ReadOnly forces read-only. Operators sign in
//     with their name (for the audit) and the token, compared in constant time, never logged or
//     echoed; sign-in attempts are rate-limited.
//   - Sessions live in the process: a random id in an HttpOnly, SameSite=Strict cookie signed
//     with a key made at start (a restart signs everyone out).
//   - Every change needs the session's CSRF token (synchronizer token) and an Origin, or a
//     Referer, naming the console's own host. Requests naming a host other than localhost, an IP
//     address or Config.AllowedHosts are refused (DNS rebinding).
//   - Every response carries a Content-Security-Policy without inline script or style,
//     X-Frame-Options DENY, nosniff and Cache-Control no-store.
//   - Nothing stored is ever rendered as markup: pages go through html/template, and stored text
//     through internal/visible, which shows control and bidi characters as escapes (\x1b,
//     \u202e); payloads are shown as text (JSON indented), or base64 when they are not UTF-8.
//     The overview's script fills the page with textContent only.
package console
