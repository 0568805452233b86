// Package exampletest gives the runnable examples of txbox's packages (func Example… with an
// // Output: comment, compiled and run by go test) what tests get from pgtest, txtest and
// kafkatest, without a testing.TB: a database of their own, with txbox installed in the schema
// "txbox" as the README's snippets assume, and a Kafka cluster of their own. Both are fresh, so an
// example's output never depends on what other tests or earlier runs left behind.
package exampletest

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/txbox/txbox/internal/pgtest"
	"github.com/txbox/txbox/migrations"
)

// Schema is where the examples install txbox, as the README does.
const Schema = "txbox"

// Env is one example's database and Kafka cluster. Close it when the example ends.
type Env struct {
	// Pool connects to the example's database with the default search_path, so the application's
	// tables are in public, and txbox's in Schema.
	Pool *pgxpool.Pool
	// Brokers are the addresses of a one-broker, one-partition-per-topic Kafka cluster that creates
	// topics on first use.
	Brokers []string

	cluster *kfake.Cluster
	drop    func() error
}

// Setup creates the database, installs txbox in Schema, runs appSQL (the application's tables) and
// starts the Kafka cluster.
func Setup(appSQL string) (_ *Env, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn, drop, err := pgtest.CreateDatabase(ctx)
	if err != nil {
		return nil, fmt.Errorf("exampletest: %w", err)
	}
	e := &Env{drop: drop}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	if e.Pool, err = pgxpool.New(ctx, dsn); err != nil {
		return nil, fmt.Errorf("exampletest: %w", err)
	}
	if _, err := e.Pool.Exec(ctx, "CREATE SCHEMA "+Schema+"; "+appSQL); err != nil {
		return nil, fmt.Errorf("exampletest: %w", err)
	}
	db := stdlib.OpenDBFromPool(e.Pool)
	_, err = migrations.Up(ctx, db, migrations.WithSchema(Schema))
	db.Close()
	if err != nil {
		return nil, fmt.Errorf("exampletest: %w", err)
	}
	e.cluster, err = kfake.NewCluster(kfake.NumBrokers(1), kfake.DefaultNumPartitions(1), kfake.AllowAutoTopicCreation())
	if err != nil {
		return nil, fmt.Errorf("exampletest: start Kafka: %w", err)
	}
	e.Brokers = e.cluster.ListenAddrs()
	return e, nil
}

// Close stops the cluster and drops the database.
func (e *Env) Close() error {
	if e.cluster != nil {
		e.cluster.Close()
	}
	if e.Pool != nil {
		e.Pool.Close()
	}
	return e.drop()
}
