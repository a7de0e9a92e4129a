-- retex ledger, version 1. Never edit a migration once committed: add the next one.

CREATE TABLE retex.tasks (
    uid              text PRIMARY KEY,                 -- the Task's Kubernetes UID
    namespace        text NOT NULL,
    name             text NOT NULL,
    spec             jsonb NOT NULL,                   -- the accepted spec (immutable by CRD rule)
    spec_hash        text NOT NULL,
    idempotency_key  text,                             -- submission dedup within a namespace
    phase            text NOT NULL CHECK (phase IN ('Pending', 'Scheduled', 'Queued', 'Running',
                         'Retrying', 'Succeeded', 'Failed', 'Cancelled', 'NeedsAttention')),
    reason           text,                             -- why the phase is what it is (CamelCase)
    dead_lettered    boolean NOT NULL DEFAULT false,
    epoch            integer NOT NULL DEFAULT 0 CHECK (epoch >= 0),  -- current attempt; 0 = none yet
    failures         integer NOT NULL DEFAULT 0 CHECK (failures >= 0),   -- failed attempts: the retry budget used
    disruptions      integer NOT NULL DEFAULT 0 CHECK (disruptions >= 0),
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    max_disruptions  integer NOT NULL CHECK (max_disruptions >= 0),
    backoff          jsonb NOT NULL,                   -- machine.Backoff fields
    not_before       timestamptz,                      -- Scheduled/Retrying wait until then
    cancel_requested boolean NOT NULL DEFAULT false,
    last_error       text,
    version          bigint NOT NULL DEFAULT 1,        -- bumped by every change to the task or its steps
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,                      -- first attempt dispatched
    finished_at      timestamptz                       -- reached a terminal phase
);
CREATE UNIQUE INDEX tasks_idempotency_key ON retex.tasks (namespace, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX tasks_waiting ON retex.tasks (not_before) WHERE phase IN ('Scheduled', 'Retrying');

CREATE TABLE retex.steps (
    task_uid         text NOT NULL REFERENCES retex.tasks (uid) ON DELETE CASCADE,
    idx              integer NOT NULL CHECK (idx >= 0),
    name             text NOT NULL,
    state            text NOT NULL DEFAULT 'pending'
                         CHECK (state IN ('pending', 'started', 'done', 'failed', 'needs-attention')),
    attempt          integer,                          -- the epoch that last began it
    idempotency_key  text NOT NULL,
    result           jsonb CHECK (result IS NULL OR octet_length(result::text) <= 65536),
    error            text,
    started_at       timestamptz,
    finished_at      timestamptz,
    PRIMARY KEY (task_uid, idx),
    UNIQUE (task_uid, name)
);

CREATE TABLE retex.attempts (
    task_uid    text NOT NULL REFERENCES retex.tasks (uid) ON DELETE CASCADE,
    epoch       integer NOT NULL CHECK (epoch >= 1),
    cause       text NOT NULL CHECK (cause IN ('first', 'retry', 'disruption', 'lease-expired', 'requeue')),
    job_name    text,
    pod         text,
    node        text,
    outcome     text CHECK (outcome IN ('succeeded', 'failed', 'lost', 'needs-attention', 'cancelled', 'superseded')),
    started_at  timestamptz NOT NULL DEFAULT now(),
    ended_at    timestamptz,
    PRIMARY KEY (task_uid, epoch)
);

-- Dispatch records: written in the same transaction as the attempt they dispatch; a relay
-- turns each into a Job and marks it sent. A record whose epoch is no longer current is skipped.
CREATE TABLE retex.outbox (
    id          bigserial PRIMARY KEY,
    task_uid    text NOT NULL REFERENCES retex.tasks (uid) ON DELETE CASCADE,
    epoch       integer NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    sent_at     timestamptz,
    outcome     text CHECK (outcome IN ('sent', 'stale'))
);
CREATE INDEX outbox_unsent ON retex.outbox (id) WHERE sent_at IS NULL;

-- Append-only: every transition of a task or step, and every human action.
CREATE TABLE retex.history (
    id          bigserial PRIMARY KEY,
    task_uid    text NOT NULL REFERENCES retex.tasks (uid) ON DELETE CASCADE,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor       text NOT NULL,                        -- operator, worker:<pod>, cli:<user>
    event       text NOT NULL,
    epoch       integer,
    step_idx    integer,
    from_state  text,
    to_state    text,
    detail      jsonb
);
CREATE INDEX history_task ON retex.history (task_uid, id);

CREATE FUNCTION retex.history_is_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'retex.history is append-only';
END $$;
CREATE TRIGGER history_append_only BEFORE UPDATE ON retex.history
    FOR EACH ROW EXECUTE FUNCTION retex.history_is_append_only();

-- Delivered at commit, so a listener never sees an uncommitted change.
CREATE FUNCTION retex.notify_task_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('retex_ledger', NEW.uid || ' ' || NEW.version);
    RETURN NULL;
END $$;
CREATE TRIGGER tasks_notify AFTER INSERT OR UPDATE ON retex.tasks
    FOR EACH ROW EXECUTE FUNCTION retex.notify_task_change();
