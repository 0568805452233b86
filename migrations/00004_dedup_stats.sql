-- Dedup checks and hits per consumer, handler and minute, so that a process other than the
-- consumer (txbox status) can show the dedup hit rate over a recent window. Each inbox adds the
-- counts it aggregated in memory at most every few seconds (inbox.Config.StatsInterval), in a
-- statement of its own, never in a message's transaction; buckets older than a week are deleted
-- by those same statements.

-- +goose Up
CREATE TABLE txbox_dedup_stats (
    minute     timestamptz NOT NULL,
    consumer   text        NOT NULL,
    handler    text        NOT NULL,
    checks     bigint      NOT NULL,
    hits       bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (minute, consumer, handler)
);

-- +goose Down
DROP TABLE txbox_dedup_stats;
