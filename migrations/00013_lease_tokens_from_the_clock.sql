-- Lease tokens go on from the database's clock, in milliseconds, so that a lease table made anew
-- (txbox migrate down, then up, or a reinstall) never hands out a token an earlier one did: the
-- sequence started again at 1, and consumers that had seen the earlier tokens on a stream counted
-- every message of the new ones as superseded. The sequence only moves forward: an installation
-- whose tokens are already past the clock keeps them.

-- +goose Up
SELECT setval('txbox_lease_token', greatest(
    (SELECT last_value FROM txbox_lease_token),
    (extract(epoch FROM clock_timestamp()) * 1000)::bigint));

-- +goose Down
-- Nothing to undo: tokens never go back.
SELECT 1;
