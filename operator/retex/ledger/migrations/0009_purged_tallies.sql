-- What the history-retention purge took from the counts the operator exports (retex_*_total and
-- the duration histograms, which are derived from append-only rows: history and attempts). The
-- purge adds what it deletes here in its own transaction, so a counter never goes down when old
-- tasks are purged. One row per (metric, label); only the purge writes it (the leader, hourly).
CREATE TABLE retex.purged_tallies (
    metric  text NOT NULL,
    label   text NOT NULL,
    value   double precision NOT NULL,
    PRIMARY KEY (metric, label)
);
