-- Admission decisions that are final, so kopf's resume handler (run at every operator start)
-- cannot decide again and run what was refused; and a cap on how long a dispatch is deferred.

-- A Task the operator refused (invalid spec, annotations too large, a Job the API server would
-- refuse, a duplicate idempotencyKey): the first refusal stands for its uid, whatever a later
-- dry run would say. Kept forever, like tombstones (a uid is never reused).
CREATE TABLE retex.refusals (
    uid         text PRIMARY KEY,
    namespace   text NOT NULL,
    name        text NOT NULL,
    reason      text NOT NULL,
    message     text NOT NULL,
    generation  bigint,                      -- metadata.generation the refusal was decided on
    refused_at  timestamptz NOT NULL DEFAULT now()
);

-- A purge must not free the purged task's idempotencyKey: a later Task with that key is a duplicate.
ALTER TABLE retex.tombstones ADD COLUMN idempotency_key text;
CREATE INDEX tombstones_idempotency_key ON retex.tombstones (namespace, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- The first time a dispatch was deferred (a transient error): past the operator's cap, counted
-- from here on the database clock, the dispatch is given up and its task fails (DispatchFailed).
ALTER TABLE retex.outbox ADD COLUMN deferred_since timestamptz;
