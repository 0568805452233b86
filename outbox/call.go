package outbox

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// MaxIdempotencyKeyLength is the longest idempotency key Stripe accepts, and so the longest a Call
// may carry.
const MaxIdempotencyKeyLength = 255

// ProviderStripe names the Stripe API in a stored CallRequest; it is the only provider so far.
const ProviderStripe = "stripe"

// ErrInvalidCall is returned (wrapped) for a call that can never be executed: a bad method or path,
// an unusable idempotency key, or no way to derive one. Nothing is written.
var ErrInvalidCall = errors.New("outbox: invalid call")

// Call is a side-effect call written into the outbox with Writer.Call: one Stripe API request that
// the relay sends, with a stable Idempotency-Key, once the transaction that wrote it has committed.
type Call struct {
	// Name tells the calls of one handler apart: it goes into the derived idempotency key, so two
	// calls of one message need two names ("charge", "refund-deposit"), and the same call written
	// again on a redelivery must keep its name. Required unless IdempotencyKey is set.
	Name string
	// Method is the HTTP method: POST or DELETE (reads have no side effect to protect). If not
	// specified, defaults to POST.
	Method string
	// Path is the API path, such as "/v1/charges" or "/v1/payment_intents/pi_123/confirm". It must
	// start with "/v1/" and carry no query string: parameters go in Params. Required.
	Path string
	// Params are the form parameters, in Stripe's encoding ("amount", "metadata[order_id]",
	// "expand[]"). They are stored as given and sent in a stable order.
	Params url.Values
	// StripeAccount, when set, sends the request on behalf of a connected account (the
	// Stripe-Account header).
	StripeAccount string
	// ReplyTopic, when set, receives one message with the call's CallResult once the call is done,
	// written by the relay in the same transaction that records the result, or that moves the call
	// to the dead-letter table (OutcomeDeadLettered). Its UUID is derived from the idempotency key,
	// so every copy of the reply is the same message to the consumer's inbox.
	ReplyTopic string
	// PartitionKey orders calls: calls with the same key are executed one after the other, in the
	// order they were written, a later one waiting while an earlier one is retried. It also chooses
	// the relay shard. If not specified, defaults to the idempotency key, so calls are independent.
	PartitionKey string
	// IdempotencyKey, when set, is used as it is instead of a derived key. It must be stable across
	// retries of whatever writes the call, or it protects nothing. At most 255 printable ASCII
	// characters, without leading or trailing spaces.
	IdempotencyKey string
	// Metadata is copied into the reply message's metadata and into the CallResult, so the reply's
	// consumer can find its own rows (an order id, say).
	Metadata map[string]string
}

// CallRequest is how a call is stored in the outbox row's payload, as JSON. It is part of the
// stored format: fields are only ever added.
type CallRequest struct {
	Provider      string     `json:"provider"`
	Name          string     `json:"name,omitempty"`
	Method        string     `json:"method"`
	Path          string     `json:"path"`
	Params        url.Values `json:"params,omitempty"`
	StripeAccount string     `json:"stripe_account,omitempty"`
}

// IdempotencyKey derives the key of the call named name that a handler makes while processing the
// message src names: "txbox_" and the unpadded base64url SHA-256 of the parts, 49 characters. Each
// part is length-prefixed before hashing, so no two different sources and names share a key.
//
// Two handlers of one consumer get different keys for calls of the same name. Without a handler
// (outside a router) the key is derived from consumer, dedup key and name alone, as it was before
// handlers took part, so the keys of calls already written do not change.
func IdempotencyKey(src Source, name string) string {
	h := sha256.New()
	parts := []string{src.Consumer, src.DedupKey, name}
	if src.Handler == "" {
		h.Write([]byte("txbox-call-key/v1"))
	} else {
		h.Write([]byte("txbox-call-key/v2"))
		parts = []string{src.Consumer, src.Handler, src.DedupKey, name}
	}
	for _, part := range parts {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write([]byte(part))
	}
	return "txbox_" + base64.RawURLEncoding.EncodeToString(h.Sum(nil))
}

// callNamespace scopes the UUIDs derived from idempotency keys (an arbitrary, fixed UUID).
var callNamespace = uuid.MustParse("6f1c2a8e-4b7d-4e0a-9c35-2d8e1f7a5b90")

// CallUUID is the UUID a call with idempotencyKey is stored under. It is derived, not random, so a
// call written twice with one key is recognisably the same call.
func CallUUID(idempotencyKey string) string {
	return uuid.NewSHA1(callNamespace, []byte("call:"+idempotencyKey)).String()
}

// ReplyUUID is the UUID of the reply message to the call with idempotencyKey. However often the
// call is completed — by a relay and by a zombie it raced with — its reply is one message.
func ReplyUUID(idempotencyKey string) string {
	return uuid.NewSHA1(callNamespace, []byte("reply:"+idempotencyKey)).String()
}

// RejectedReplyUUID is the UUID of the reply to the call with idempotencyKey, stored as outbox row
// row, when the provider rejected it (OutcomeRejected). The provider stores no outcome for a
// request it refused, so a call written again with the key, its parameters corrected, executes;
// its reply, under ReplyUUID, must not be taken by the consumer's inbox for a copy of the
// rejection, nor a second rejection's (the parameters still wrong) for a copy of the first.
func RejectedReplyUUID(idempotencyKey string, row int64) string {
	return uuid.NewSHA1(callNamespace, fmt.Appendf(nil, "rejected-reply:%d:%s", row, idempotencyKey)).String()
}

// DeadLetteredReplyUUID is the UUID of the reply to the call with idempotencyKey, stored as outbox
// row row, when it was moved to the dead-letter table (OutcomeDeadLettered), by the relay or by an
// operator: a call written again with the key may still complete, and its reply, under ReplyUUID,
// must not be taken for a copy of this one, nor the reply of its own burial for a copy of the
// first's. A row is dead-lettered once, so its reply is one message.
func DeadLetteredReplyUUID(idempotencyKey string, row int64) string {
	return uuid.NewSHA1(callNamespace, fmt.Appendf(nil, "dead-lettered-reply:%d:%s", row, idempotencyKey)).String()
}

// Call writes c into the outbox through tx and returns its idempotency key. Unless c carries an
// explicit key, the key is derived (IdempotencyKey) from the consumer, handler and dedup key that
// the inbox middleware put in ctx (see ContextWithSource) and c.Name, so a redelivered message yields the same
// key and the provider executes the call once. The trace context of ctx is stored with the call and
// passed on to its reply.
//
// It returns an error wrapping ErrInvalidCall, and writes nothing, when c cannot be executed or no
// key can be had: outside a handler, set IdempotencyKey, or call ContextWithSource with something
// stable first (a Source without a DedupKey is none: every call of a name would share its key). A
// second call with a derived key of the same Name in one transaction is refused the same way: it
// would share the first one's key. So is a call with a derived key through an Execer outside a
// transaction (a pool, a *sql.DB), where each statement is a transaction of its own and a second
// call cannot be told from the first.
func (w *Writer) Call(ctx context.Context, tx Execer, c Call) (idempotencyKey string, err error) {
	if err := checkExecer(tx); err != nil {
		return "", err
	}
	key, err := callKey(ctx, c)
	if err != nil {
		return "", err
	}
	method := strings.ToUpper(c.Method)
	if method == "" {
		method = http.MethodPost
	}
	if method != http.MethodPost && method != http.MethodDelete {
		return "", fmt.Errorf("%w: Call.Method %q: want POST or DELETE", ErrInvalidCall, c.Method)
	}
	if err := checkPath(c.Path); err != nil {
		return "", err
	}
	if strings.ContainsFunc(c.StripeAccount, notPrintable) || strings.TrimSpace(c.StripeAccount) != c.StripeAccount {
		return "", fmt.Errorf("%w: Call.StripeAccount %q is not a header value", ErrInvalidCall, c.StripeAccount)
	}
	if err := checkCallText(c); err != nil {
		return "", err
	}
	payload, err := json.Marshal(CallRequest{
		Provider: ProviderStripe, Name: c.Name, Method: method, Path: c.Path,
		Params: c.Params, StripeAccount: c.StripeAccount,
	})
	if err != nil {
		return "", fmt.Errorf("outbox: encode call %s: %w", key, err)
	}
	if len(payload) > w.maxPayloadBytes {
		return "", fmt.Errorf("%w: %s: Call.Params: the request is %d bytes, over the %d-byte limit", ErrInvalidCall, key, len(payload), w.maxPayloadBytes)
	}

	meta := string(appendMetadata(nil, c.Metadata, traceFieldsOf(ctx))) // text, as in Publish

	partitionKey := c.PartitionKey
	if partitionKey == "" {
		partitionKey = key
	}
	// Only a derived key can be shared by mistake; an explicit key written twice is the caller's
	// choice (the second call gets the provider's replay of the first).
	derived := c.IdempotencyKey == ""
	insert := w.insertCall
	if derived {
		insert = w.insertDerivedCall
		in, err := inTransaction(ctx, tx)
		if err != nil {
			return "", fmt.Errorf("outbox: call %s: %w", key, err)
		}
		if !in {
			return "", fmt.Errorf("%w: a call of a derived key needs a transaction: through %T each statement is a transaction of its own, "+
				"where a second call of Call.Name %q for this message cannot be told; write it in the transaction of the message's other writes, or set Call.IdempotencyKey",
				ErrInvalidCall, tx, c.Name)
		}
	}
	id := CallUUID(key)
	tag, err := tx.Exec(ctx, insert, c.ReplyTopic, SlotOf(partitionKey, id), partitionKey, id, payload, meta, key)
	switch {
	case err != nil:
		return "", insertError("call "+key, err)
	case !derived:
	case !tag.Insert():
		return "", fmt.Errorf("outbox: insert call %s: the Execer returned the command tag %q, not an INSERT's: a wrapper must pass pgx's tag on, which Call reads", key, tag)
	case tag.RowsAffected() == 0:
		return "", fmt.Errorf("%w: Call.Name %q is already used by a call of this message in this transaction: "+
			"the two would share the idempotency key %s and the provider would execute only the first; give each call its own name",
			ErrInvalidCall, c.Name, key)
	}
	return key, nil
}

// inTransaction reports whether tx's statements run in one transaction block, where the unique
// index can tell a second call of a name from the first; through a pool, say, each is a
// transaction of its own. Transactions, connections and database/sql's handles are told by their
// type and state; anything else (a wrapper of the caller's) is asked with a savepoint, which only
// a transaction block takes: two more round trips, for such Execers only.
func inTransaction(ctx context.Context, tx Execer) (bool, error) {
	switch t := tx.(type) {
	case pgx.Tx:
		return true, nil
	case *pgxpool.Pool:
		return false, nil
	case *pgx.Conn:
		return inBlock(t), nil
	case pgxConner: // *pgxpool.Conn
		return inBlock(t.Conn()), nil
	case sqlExecer:
		switch s := t.tx.(type) {
		case *sql.Tx:
			return true, nil
		case *sql.DB:
			return false, nil
		case *sql.Conn:
			known, in := false, false
			_ = s.Raw(func(driverConn any) error {
				if c, ok := driverConn.(pgxConner); ok { // pgx's database/sql driver
					known, in = true, inBlock(c.Conn())
				}
				return nil
			})
			if known {
				return in, nil
			}
		}
	}
	_, err := tx.Exec(ctx, "SAVEPOINT txbox_call_check")
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "25P01" { // no_active_sql_transaction
		return false, nil
	}
	if err == nil {
		_, err = tx.Exec(ctx, "RELEASE SAVEPOINT txbox_call_check")
	}
	return err == nil, err
}

// pgxConner is what a pool's connection and a connection of pgx's database/sql driver have.
type pgxConner interface{ Conn() *pgx.Conn }

// inBlock reports whether c is in a transaction block, failed or not.
func inBlock(c *pgx.Conn) bool { return c.PgConn().TxStatus() != 'I' }

func callKey(ctx context.Context, c Call) (string, error) {
	if c.IdempotencyKey != "" {
		k := c.IdempotencyKey
		switch {
		case len(k) > MaxIdempotencyKeyLength:
			return "", fmt.Errorf("%w: Call.IdempotencyKey of %d characters is over Stripe's limit of %d", ErrInvalidCall, len(k), MaxIdempotencyKeyLength)
		case strings.TrimSpace(k) != k, strings.ContainsFunc(k, notPrintable):
			// stripe-go trims the header value, and Stripe would see another key than the one stored.
			return "", fmt.Errorf("%w: Call.IdempotencyKey %q must be printable ASCII without leading or trailing spaces", ErrInvalidCall, k)
		}
		return k, nil
	}
	src, ok := SourceFromContext(ctx)
	if !ok {
		return "", fmt.Errorf("%w: no idempotency key: ctx carries no inbox message (use the handler's message context, or set Call.IdempotencyKey)", ErrInvalidCall)
	}
	if src.DedupKey == "" {
		// Every call of the name would share one key, and the provider would execute only the first.
		return "", fmt.Errorf("%w: no idempotency key: ctx's Source has no DedupKey (ContextWithSource needs the message's stable key, or set Call.IdempotencyKey)", ErrInvalidCall)
	}
	if c.Name == "" {
		return "", fmt.Errorf("%w: Call.Name is required to derive the idempotency key: it tells the calls of one message apart", ErrInvalidCall)
	}
	return IdempotencyKey(src, c.Name), nil
}

// checkCallText checks the call's free text as Publish checks a message's: the name and the
// parameters go into the stored request (JSON would rewrite invalid UTF-8 in them, and the key is
// derived from the name as given), the reply topic, partition key and metadata into columns.
func checkCallText(c Call) error {
	for _, f := range []struct{ what, value string }{
		{"Call.Name", c.Name}, {"Call.ReplyTopic", c.ReplyTopic}, {"Call.PartitionKey", c.PartitionKey},
	} {
		if err := checkText(ErrInvalidCall, f.what, f.value); err != nil {
			return err
		}
	}
	for k, vs := range c.Params {
		if err := checkText(ErrInvalidCall, "Call.Params: key", k); err != nil {
			return err
		}
		for _, v := range vs {
			if err := checkText(ErrInvalidCall, fmt.Sprintf("Call.Params: value of %q", k), v); err != nil {
				return err
			}
		}
	}
	return checkMetadata(ErrInvalidCall, "Call.Metadata", c.Metadata)
}

func checkPath(p string) error {
	if !strings.HasPrefix(p, "/v1/") || len(p) == len("/v1/") {
		return fmt.Errorf("%w: Call.Path %q: want a Stripe API path such as /v1/charges", ErrInvalidCall, p)
	}
	for _, r := range p {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("/_-.", r)
		if !ok {
			return fmt.Errorf("%w: Call.Path %q: only letters, digits and /_-. are allowed (parameters go in Call.Params)", ErrInvalidCall, p)
		}
	}
	if strings.Contains(p, "..") || strings.Contains(p, "//") {
		return fmt.Errorf("%w: Call.Path %q is not a plain API path", ErrInvalidCall, p)
	}
	return nil
}

func notPrintable(r rune) bool { return r < 0x20 || r > 0x7e }

// Outcomes of a completed call, in CallResult.Outcome and txbox_call_result.outcome.
const (
	// OutcomeSucceeded: the provider answered 2xx.
	OutcomeSucceeded = "succeeded"
	// OutcomeDeclined: the provider refused on business grounds (a card declined, HTTP 402). The
	// call is done: trying again with the same key would get the same answer.
	OutcomeDeclined = "declined"
	// OutcomeRejected: the provider refused the request itself (HTTP 400 or 404, such as a missing
	// parameter or an unknown object). Sending it again cannot succeed, so the call is done too.
	OutcomeRejected = "rejected"
	// OutcomeDeadLettered: the relay gave up on the call and moved it to the dead-letter table, and
	// will not send it again; Error.Code is the letter's reason and Error.Message its detail. Whether
	// the provider executed it may be unknown (reasons "call outcome indeterminate", "call replay
	// window passed"): reconcile with the provider (see package dlq). HTTPStatus is 0; the letter
	// has the provider's last answer.
	OutcomeDeadLettered = "dead_lettered"
)

// CallResult is the payload of a call's reply message (JSON): what the provider answered.
type CallResult struct {
	// CallUUID and IdempotencyKey identify the call.
	CallUUID       string `json:"call_uuid"`
	IdempotencyKey string `json:"idempotency_key"`
	// Name is the Call's Name.
	Name string `json:"name,omitempty"`
	// Outcome is OutcomeSucceeded, OutcomeDeclined, OutcomeRejected or, in a reply only,
	// OutcomeDeadLettered.
	Outcome string `json:"outcome"`
	// HTTPStatus is the provider's HTTP status.
	HTTPStatus int `json:"http_status"`
	// ObjectID is the id of the object the call created or touched ("ch_…", "pi_…"); for a declined
	// charge, the id of the failed charge.
	ObjectID string `json:"object_id,omitempty"`
	// Object is the type of that object ("charge", "payment_intent") when the response said.
	Object string `json:"object,omitempty"`
	// Status is the object's status field ("succeeded", "requires_action"), when it has one.
	Status string `json:"status,omitempty"`
	// Error describes a declined, rejected or dead-lettered call.
	Error *CallError `json:"error,omitempty"`
	// Body is the response body, when it is JSON and within the relay's size limit.
	Body json.RawMessage `json:"body,omitempty"`
	// BodyTruncated is true when the body was over the limit and left out.
	BodyTruncated bool `json:"body_truncated,omitempty"`
	// Attempts is how many times the request was sent.
	Attempts int `json:"attempts"`
	// Metadata is the Call's Metadata.
	Metadata map[string]string `json:"metadata,omitempty"`
}

// CallError is the provider's error object of a declined or rejected call.
type CallError struct {
	Type        string `json:"type,omitempty"`
	Code        string `json:"code,omitempty"`
	DeclineCode string `json:"decline_code,omitempty"`
	Param       string `json:"param,omitempty"`
	Message     string `json:"message,omitempty"`
}

// ParseCallResult decodes the CallResult carried by a reply message.
func ParseCallResult(msg *message.Message) (CallResult, error) {
	var r CallResult
	if err := json.Unmarshal(msg.Payload, &r); err != nil {
		return CallResult{}, fmt.Errorf("outbox: decode call result %s: %w", msg.UUID, err)
	}
	if r.IdempotencyKey == "" || r.Outcome == "" {
		return CallResult{}, fmt.Errorf("outbox: message %s is not a call result", msg.UUID)
	}
	return r, nil
}
