package pgtext_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/txbox/txbox/internal/pgtext"
	"github.com/txbox/txbox/internal/txtest"
)

// FuzzLiteralReadsBackAsWritten: PostgreSQL reads every valid string written by Literal as the same
// string, whether or not standard_conforming_strings is on, and the constant ends where it should
// (what follows it in the statement is still read as SQL).
func FuzzLiteralReadsBackAsWritten(f *testing.F) {
	env := txtest.New(f)
	conn, err := pgx.Connect(context.Background(), env.URL)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = conn.Close(context.Background()) })
	for _, s := range []string{"", "plain", "it's", `back\slash`, `\'`, `'\`, "''", `E'x'`, "$1", "-- comment", "/* c */", "é€😀", "a\nb\tc\r", "\x7f\x01"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !pgtext.Valid(s) {
			t.Skip("PostgreSQL does not accept the string as text")
		}
		for _, conforming := range []string{"on", "off"} {
			if _, err := conn.Exec(context.Background(), "SET standard_conforming_strings = "+conforming); err != nil {
				t.Fatal(err)
			}
			// In the simple query protocol, as the inbox sends constants (pgx's own simple
			// protocol would refuse to run with standard_conforming_strings off).
			results, err := conn.PgConn().Exec(context.Background(), "SELECT "+pgtext.Literal(s)+"::text, 1").ReadAll()
			if err != nil {
				t.Fatalf("standard_conforming_strings=%s: SELECT %s: %v", conforming, pgtext.Literal(s), err)
			}
			if row := results[0].Rows[0]; string(row[0]) != s || string(row[1]) != "1" {
				t.Fatalf("standard_conforming_strings=%s: wrote %q, read back %q", conforming, s, row)
			}
		}
	})
}

// Constants keep their meaning wherever a parameter stands: a negative number after a minus sign
// does not start a comment, NULL pointers are NULL, and a string PostgreSQL would refuse is an error.
func TestWriteConstants(t *testing.T) {
	env := txtest.New(t)
	three, none := int64(3), (*int32)(nil)
	var b strings.Builder
	b.WriteString("SELECT 5 -")
	if err := pgtext.WriteConstants(&b, -3); err != nil {
		t.Fatal(err)
	}
	b.WriteString(", ")
	if err := pgtext.WriteConstants(&b, &three, none, true, "x"); err != nil {
		t.Fatal(err)
	}
	var (
		diff, n int64
		null    *int32
		yes     bool
		x       string
	)
	err := env.Pool.QueryRow(context.Background(), b.String(), pgx.QueryExecModeSimpleProtocol).Scan(&diff, &n, &null, &yes, &x)
	if err != nil {
		t.Fatalf("%s: %v", b.String(), err)
	}
	if diff != 8 || n != 3 || null != nil || !yes || x != "x" {
		t.Fatalf("%s read back %d, %d, %v, %t, %q", b.String(), diff, n, null, yes, x)
	}
	for _, bad := range []any{"nul\x00", "\xff", 1.5} {
		if err := pgtext.WriteConstants(&strings.Builder{}, bad); err == nil {
			t.Errorf("WriteConstants(%#v) wrote a constant", bad)
		}
	}
}
