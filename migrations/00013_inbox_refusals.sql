-- txbox_refuse lets a statement end its query with an error of a given SQLSTATE. The inbox opens a
-- delivery's transaction with one multi-statement query (its crash marker, the checks and its inbox
-- row, in one round trip), and such a query returns to the client only whether it failed, and how:
-- a statement that finds the message already processed, or not fresh, says so by failing with the
-- inbox's own SQLSTATE (package inbox, sql.go), which also stops the statements after it.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION txbox_refuse(sqlstate text, reason text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF sqlstate IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = sqlstate, MESSAGE = reason;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION txbox_refuse(text, text);
