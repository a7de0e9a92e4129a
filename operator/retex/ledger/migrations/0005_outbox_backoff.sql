-- Each dispatch record has its own outcome, so one record the API server refuses can never hold
-- up the records behind it: a permanent refusal fails that task ('rejected'), a dispatch for a
-- task cancelled or deleted before its Job existed is 'dropped', and a transient error puts only
-- that record off until not_before (its tries counted in attempts, the error kept in last_error).
ALTER TABLE retex.outbox
    ADD COLUMN attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    ADD COLUMN not_before timestamptz,
    ADD COLUMN last_error text,
    DROP CONSTRAINT outbox_outcome_check,
    ADD CONSTRAINT outbox_outcome_check CHECK (outcome IN ('sent', 'stale', 'rejected', 'dropped'));
