-- Attempt lifecycle: when an attempt is known dead, why a cancel was asked, and which tasks were purged.

-- An attempt holds its run slot and concurrency key until it is known dead ("settled"): its worker
-- ended it itself, or its lease was released or expired, or its pod is gone. An attempt the operator
-- ended (task timeout, deletion) may still be running a step until then.
ALTER TABLE retex.attempts ADD COLUMN settled_at timestamptz;
UPDATE retex.attempts SET settled_at = coalesce(ended_at, now()) WHERE outcome IS NOT NULL;
CREATE INDEX attempts_unsettled ON retex.attempts (task_uid) WHERE settled_at IS NULL AND outcome IS NOT NULL;

-- The reason a cancel ends with (Cancelled or TaskDeleted) when the operator ends it.
ALTER TABLE retex.tasks ADD COLUMN cancel_reason text;

-- A purged task must never be admitted again (the Task object may outlive its ledger row): one row
-- per purged uid, kept forever (it is tiny).
CREATE TABLE retex.tombstones (
    uid        text PRIMARY KEY,
    namespace  text NOT NULL,
    name       text NOT NULL,
    phase      text NOT NULL,
    purged_at  timestamptz NOT NULL DEFAULT now()
);
