-- The reaper reads watched() every second. Without these, both joins were sequential scans that
-- grow with history (measured: 200 000 finished tasks, 50 Running, 69 ms a call); with them two
-- index scans and a nested loop (1 ms). The partial index holds only attempts not known over.
CREATE INDEX attempts_watched ON retex.attempts (task_uid, epoch) WHERE outcome IS NULL OR settled_at IS NULL;
CREATE INDEX outbox_attempt ON retex.outbox (task_uid, epoch);
