-- Policies: concurrency keys, priorities, run limits and task timeouts.

ALTER TABLE retex.tasks
    ADD COLUMN concurrency_key text,
    ADD COLUMN priority integer NOT NULL DEFAULT 0,
    ADD COLUMN timeout_seconds integer CHECK (timeout_seconds > 0),
    ADD COLUMN deadline_at timestamptz,          -- first start + timeout_seconds
    ADD COLUMN next_cause text CHECK (next_cause IN ('first', 'retry', 'requeue'));  -- of a Queued task

CREATE INDEX tasks_queued ON retex.tasks (priority DESC, created_at) WHERE phase = 'Queued';
CREATE INDEX tasks_keyed ON retex.tasks (namespace, concurrency_key)
    WHERE concurrency_key IS NOT NULL AND phase NOT IN ('Succeeded', 'Failed', 'Cancelled');
CREATE INDEX tasks_deadline ON retex.tasks (deadline_at)
    WHERE deadline_at IS NOT NULL AND phase NOT IN ('Succeeded', 'Failed', 'Cancelled');

-- One row: limits on running attempts, written by the operator, read by every placement so
-- that whichever process frees a slot (often a worker completing its task) fills it correctly.
CREATE TABLE retex.run_limits (
    singleton              boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    max_running            integer CHECK (max_running > 0),            -- NULL: unlimited
    max_running_per_namespace integer CHECK (max_running_per_namespace > 0)
);
INSERT INTO retex.run_limits DEFAULT VALUES;
