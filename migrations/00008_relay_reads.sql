-- The relay reads a shard's calls in id order and holds a call back while an earlier call of its
-- partition key is pending.

-- +goose Up

-- The "earlier call of this key" look is one probe of this index rather than a walk over the
-- slot's earlier calls; it holds call rows only, which are few beside messages.
CREATE INDEX txbox_outbox_call_order ON txbox_outbox (slot, partition_key, id) WHERE kind = 'call';

-- +goose Down
DROP INDEX txbox_outbox_call_order;
