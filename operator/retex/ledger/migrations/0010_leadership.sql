-- The leadership term: one row. A process that becomes the control plane's leader takes the next
-- term (UPDATE, which waits for every transaction holding the row FOR SHARE); each of the
-- leader's writes reads the row FOR SHARE first and is refused unless the term is still its own
-- (retex.ledger.transactions: check_term, take_term). Nothing else writes it.
CREATE TABLE retex.leadership (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    term      bigint NOT NULL
);
INSERT INTO retex.leadership (singleton, term) VALUES (true, 0);
