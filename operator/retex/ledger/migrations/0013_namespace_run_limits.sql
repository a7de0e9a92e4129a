-- A namespace's own limit on running attempts (its TaskPolicy's maxRunning), applied by every
-- placement together with the global limits of retex.run_limits (the smaller wins). The ledger
-- knows no TaskPolicy: the operator's leader writes these rows from its watch of them. No row: only
-- the global limits.
CREATE TABLE retex.namespace_run_limits (
    namespace    text PRIMARY KEY,
    max_running  integer NOT NULL CHECK (max_running > 0)
);
