package pgserver

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Restart must end every session, keep committed data and come back on the same URL, in both
// shutdown modes; a server this process did not start must refuse it.
func TestRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := StartThrowaway(ctx, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	stopInCleanup(t, s)

	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { conn.Close(context.Background()) }()
	if _, err := conn.Exec(ctx, "CREATE TABLE kept (n int); INSERT INTO kept VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{"fast", "immediate"} {
		if err := s.Restart(ctx, mode, 100*time.Millisecond); err != nil {
			t.Fatalf("Restart(%s): %v", mode, err)
		}
		if err := conn.Ping(ctx); err == nil {
			t.Fatalf("a session survived Restart(%s)", mode)
		}
		conn.Close(ctx)
		if conn, err = pgx.Connect(ctx, s.URL); err != nil {
			t.Fatalf("connect after Restart(%s): %v", mode, err)
		}
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM kept").Scan(&n); err != nil || n != 1 {
			t.Fatalf("after Restart(%s): %d rows, %v; want the committed row", mode, n, err)
		}
	}
	if err := s.Restart(ctx, "smart", 0); err == nil {
		t.Error("Restart accepted an unknown mode")
	}
	if err := (&Server{URL: DefaultURL}).Restart(ctx, "fast", 0); err == nil {
		t.Error("Restart accepted a server it did not start")
	}
}
