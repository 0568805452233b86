package outbox_test

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the database/sql driver goose migrates through

	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/migrations"
	"github.com/txbox/txbox/outbox"
)

// A business row and the event announcing it commit together, or neither does.
func ExampleWriter_Publish() {
	ctx := context.Background()
	url, err := pgtest.URL()
	if err != nil {
		fmt.Println(err)
		return
	}
	const schema = "txbox_example_outbox"
	db, err := sql.Open("pgx", url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()
	defer db.ExecContext(ctx, "DROP SCHEMA "+schema+" CASCADE") //nolint:errcheck // Best-effort cleanup.
	if _, err := migrations.Up(ctx, db, migrations.WithSchema(schema)); err != nil {
		fmt.Println(err)
		return
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	_, _ = pool.Exec(ctx, "CREATE TABLE "+schema+".orders (id text PRIMARY KEY)")

	w, err := outbox.New(outbox.Config{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	placeOrder := func(id string, commit bool) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx) //nolint:errcheck // A no-op after Commit.
		if _, err := tx.Exec(ctx, "INSERT INTO "+schema+".orders VALUES ($1)", id); err != nil {
			return err
		}
		event := outbox.SetPartitionKey(message.NewMessage("order-placed-"+id, []byte(`{"order":"`+id+`"}`)), id)
		if err := w.Publish(ctx, tx, "orders.placed", event); err != nil {
			return err
		}
		if !commit {
			return nil
		}
		return tx.Commit(ctx)
	}
	if err := placeOrder("1", true); err != nil {
		fmt.Println(err)
		return
	}
	if err := placeOrder("2", false); err != nil {
		fmt.Println(err)
		return
	}

	rows, _ := pool.Query(ctx, "SELECT uuid, topic, partition_key FROM "+schema+".txbox_outbox ORDER BY id")
	for rows.Next() {
		var uuid, topic, key string
		_ = rows.Scan(&uuid, &topic, &key)
		fmt.Printf("pending: %s on %s, key %s\n", uuid, topic, key)
	}
	// Output:
	// pending: order-placed-1 on orders.placed, key 1
}
