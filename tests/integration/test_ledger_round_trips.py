"""How many round trips to Postgres a step costs: the checkpoint's floor is one INSERT and one
COMMIT, so each round trip of `begin_step` and `commit_step` shows in every step's time."""

from retex.ledger import Ledger
from tests.integration.ledger_helpers import admitted


def round_trips(conn, call) -> int:
    """Messages that wait for the server's answer in libpq's trace of `conn` while `call` runs:
    Sync (a statement, extended protocol) and Query (BEGIN, COMMIT, the pool's check)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        try:
            call()
        finally:
            conn.pgconn.untrace()  # flushes the trace
        sent = [line.split("\t")[3].split()[0] for line in open(trace.name).read().splitlines() if "\tF\t" in line]
    return sent.count("Sync") + sent.count("Query")


def test_a_step_begin_and_its_commit_each_take_five_round_trips(dsn):
    # Each: BEGIN, the task row's lock, the step row's lock, the step's move (its update, history
    # row and the task's version in one statement), COMMIT. No check of a connection just used.
    with Ledger(dsn, max_connections=1) as ledger:
        uid = admitted(ledger)
        with ledger._pool.connection() as conn:
            pass  # the pool's one connection, traced below while the ledger uses it
        assert round_trips(conn, lambda: ledger.begin_step(uid, 1, 0, actor="worker")) == 5
        assert round_trips(conn, lambda: ledger.commit_step(uid, 1, 0, {"ok": 1}, actor="worker")) == 5
