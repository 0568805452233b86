package chaos

import (
	"context"
	"errors"
	"net/url"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/txbox/txbox/inbox"
	"github.com/txbox/txbox/outbox"
)

// Execer is the part of pgx that CreateTables needs.
type Execer interface {
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
}

// CreateTables creates the tables the tests' producers and consumers write beside txbox's own in
// schema: produced, the ledger of committed messages (a producer inserts a message's row in the
// transaction that writes it to the outbox, so the ledger is exactly the committed messages, in
// commit order per key), and effects, one row per application of a message's business effect.
func CreateTables(ctx context.Context, db Execer, schema string) error {
	_, err := db.Exec(ctx, `
CREATE TABLE `+table(schema, "produced")+` (
	seq  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	uuid text NOT NULL UNIQUE,
	key  text NOT NULL
);
CREATE TABLE `+table(schema, "effects")+` (
	seq      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	consumer text NOT NULL,
	uuid     text NOT NULL,
	key      text NOT NULL
)`)
	return err
}

// ChargeName is the name of the Stripe call Apply writes for each message.
const ChargeName = "charge"

// HandlerName is the name of the router handler that runs Apply in the consumer processes.
const HandlerName = "effects"

// ChargeKey is the idempotency key of the charge that consumer's handler writes for the message uuid.
func ChargeKey(consumer, uuid string) string {
	return outbox.IdempotencyKey(outbox.Source{Consumer: consumer, Handler: HandlerName, DedupKey: uuid}, ChargeName)
}

// Apply returns the consumers' handler, to run behind the inbox middleware: it records the
// message's business effect in schema's effects table through the inbox's transaction and, when
// charges is not nil, writes a Stripe charge for it into the outbox in that same transaction (its
// idempotency key is ChargeKey). Charges are independent of each other: they have no partition key.
func Apply(schema string, charges *outbox.Writer) message.NoPublishHandlerFunc {
	insert := "INSERT INTO " + table(schema, "effects") + " (consumer, uuid, key) VALUES ($1, $2, $3)"
	return func(msg *message.Message) error {
		ctx := msg.Context()
		tx, ok := inbox.TxFromContext(ctx)
		if !ok {
			return errors.New("chaos: the handler runs without the inbox's transaction")
		}
		src, _ := outbox.SourceFromContext(ctx)
		key := msg.Metadata.Get(outbox.PartitionKeyMetadata)
		if _, err := tx.Exec(ctx, insert, src.Consumer, msg.UUID, key); err != nil {
			return err
		}
		if charges == nil {
			return nil
		}
		_, err := charges.Call(ctx, tx, outbox.Call{
			Name: ChargeName, Path: "/v1/charges",
			Params: url.Values{"amount": {"1000"}, "currency": {"usd"}, "source": {"tok_visa"}, "metadata[message]": {msg.UUID}},
		})
		return err
	}
}

func table(schema, name string) string { return pgx.Identifier{schema, name}.Sanitize() }
