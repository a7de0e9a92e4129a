-- A worker's begin_step may be sent twice when its reply is lost (the operator's ledger endpoint
-- died between COMMIT and the reply). The request id of the begin, and the step as it was before
-- that begin, let the repeat get the first answer: without them a repeat finds the step started by
-- its own attempt and judges it interrupted (for a step neither idempotent nor verifiable: stop for
-- a human although nothing ran).
ALTER TABLE retex.steps
    ADD COLUMN begin_request text,
    ADD COLUMN prior_state text,
    ADD COLUMN prior_attempt integer,
    ADD COLUMN prior_started_at timestamptz;
