-- FIFO order is the order users submitted tasks in (the Task's creationTimestamp), not the order
-- the operator happened to admit them: after an operator restart a backlog is admitted at once,
-- in no particular order. creationTimestamp has one-second resolution; admission order breaks ties.
ALTER TABLE retex.tasks ADD COLUMN submitted_at timestamptz;
