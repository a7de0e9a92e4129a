-- The Task is the ledger's witness: a Task whose status shows more than the ledger holds of it
-- (the ledger restored from a backup, failed over to a replica that lost commits, or a fresh
-- database) is frozen, never run again from what the ledger forgot, until a human recovers it.

-- Why the task is frozen: LedgerBehind (the ledger holds it at a version below the one its status
-- showed) or LedgerLost (the ledger did not hold it at all); NULL: not frozen. `witness` is the
-- Task's status as it was found (what `recover --from-status` rebuilds the steps from).
ALTER TABLE retex.tasks
    ADD COLUMN frozen_reason text CHECK (frozen_reason IN ('LedgerBehind', 'LedgerLost')),
    ADD COLUMN witness jsonb;
CREATE INDEX tasks_frozen ON retex.tasks (uid) WHERE frozen_reason IS NOT NULL;

-- Which install of retex owns this ledger: one row, written by the first operator that starts on
-- it. An operator of another install (another namespace or cluster, a uid of its own) refuses to
-- start rather than fight over the leadership term.
CREATE TABLE retex.install (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    uid         text NOT NULL,
    namespace   text NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now()
);
