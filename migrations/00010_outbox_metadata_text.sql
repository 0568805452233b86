-- The outbox's metadata becomes text. Only outbox.Writer writes it, as a JSON object it encodes
-- from a map[string]string of text it has already checked, and every reader decodes it in Go (or
-- selects metadata::text), so PostgreSQL parsing it into jsonb on every insert bought nothing and
-- was the largest single cost of an outbox write. Rewrites the table: the outbox holds only pending
-- rows, so this is quick unless a backlog is waiting.

-- +goose Up
ALTER TABLE txbox_outbox ALTER COLUMN metadata DROP DEFAULT,
    ALTER COLUMN metadata TYPE text,
    ALTER COLUMN metadata SET DEFAULT '{}';

-- +goose Down
ALTER TABLE txbox_outbox ALTER COLUMN metadata DROP DEFAULT,
    ALTER COLUMN metadata TYPE jsonb USING metadata::jsonb,
    ALTER COLUMN metadata SET DEFAULT '{}';
