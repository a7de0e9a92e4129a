"""The leadership fence on the control plane's ledger writes: a Ledger made with
`leader_fenced=True` (the operator's) writes only under the ledger's current leadership term; a
successor's `take_term` waits for its predecessor's writes under way and refuses every later
one; with the operator's `SessionLimits`, a predecessor frozen inside a transaction, or frozen
while its statement waits for a lock, is ended by the server, so it cannot hold the term (or any
row) for ever. Without `leader_fenced` (the CLI's administrator writes) nothing is fenced."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from retex.ledger import Ledger, LedgerUnavailable, NotLeader, operator_operations, transactions
from retex.ledger.rows import Cursor
from retex.ledger.transactions import SessionLimits
from tests.integration.ledger_helpers import admission, admitted, run_all_steps

LIMITS = SessionLimits(idle_in_transaction_seconds=1.0, lock_timeout_seconds=1.0)
TAKE_TIMEOUT = 0.3  # what a new leader waits per try of take_term


@pytest.fixture
def replicas(dsn, ledger):
    """Two operator replicas' ledgers on one database (`ledger` migrated it)."""
    with (Ledger(dsn, retry_for_seconds=5, limits=LIMITS, leader_fenced=True) as a,
          Ledger(dsn, retry_for_seconds=5, limits=LIMITS, leader_fenced=True) as b):
        yield a, b


@contextmanager
def writing(leader: Ledger) -> Iterator[Cursor]:
    """A leader's write transaction the test keeps open, as a process that froze (or stalled)
    inside one would: the Ledger's own fenced transaction."""
    with leader._transaction(leader=True) as cur:
        yield cur


def cancel(cur: Cursor, uid: str) -> None:
    """A leader's write in that transaction."""
    operator_operations.request_cancel(cur, uid, reason="Cancelled", actor="operator")


def outbox_rows(ledger: Ledger) -> int:
    with psycopg.connect(ledger._dsn) as conn:
        return conn.execute("SELECT count(*) FROM retex.outbox").fetchone()[0]


def test_a_replica_that_took_no_term_writes_nothing(replicas, ledger):
    first, _ = replicas
    with pytest.raises(NotLeader, match="taken no leadership term"):
        first.admit(admission())
    assert outbox_rows(ledger) == 0


def test_a_replaced_leaders_writes_are_refused_and_write_nothing(replicas, ledger):
    old, new = replicas
    assert old.take_term(lock_timeout_seconds=TAKE_TIMEOUT) == 1
    uid = admitted(old)
    assert new.take_term(lock_timeout_seconds=TAKE_TIMEOUT) == 2
    history = ledger.history(uid)
    with pytest.raises(NotLeader, match="term is 2, this writer's is 1"):
        old.admit(admission())
    with pytest.raises(NotLeader):
        old.dispatch_batch(limit=20, claim_seconds=5)
    for write in (lambda: old.request_cancel(uid), lambda: old.promote_due(), lambda: old.fill_slots(),
                  lambda: old.replace_attempt(uid, 1, cause="test"), lambda: old.requeue(uid, actor="test")):
        with pytest.raises(NotLeader):
            write()
    assert outbox_rows(ledger) == 1 and not ledger.get(uid).cancel_requested
    assert ledger.history(uid) == history
    new.request_cancel(uid)  # the new leader writes
    assert ledger.get(uid).cancel_requested


def test_taking_a_term_waits_for_the_predecessors_write_under_way_which_commits_first(replicas, ledger):
    old, new = replicas
    old.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
    uid = admitted(old)
    with writing(old) as cur:
        with pytest.raises(psycopg.errors.LockNotAvailable):
            new.take_term(lock_timeout_seconds=TAKE_TIMEOUT)  # the write holds the term: the successor waits (here, its lock timeout)
        cancel(cur, uid)
    assert new.take_term(lock_timeout_seconds=TAKE_TIMEOUT) == 2  # after the write committed
    assert ledger.get(uid).cancel_requested


def test_a_predecessor_frozen_in_its_transaction_is_ended_by_the_server_and_its_write_refused(replicas, ledger):
    old, new = replicas
    old.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
    uid = admitted(old)
    taken: list[int] = []
    with pytest.raises(NotLeader, match="sat idle for 1s: nothing of it was written"), writing(old) as cur:
        cur.execute("SELECT 1 FROM retex.tasks WHERE uid = %s FOR UPDATE", (uid,))
        successor = threading.Thread(target=lambda: taken.append(take_until_taken(new)))
        successor.start()
        successor.join(timeout=10)  # frozen: no statement while the successor waits
        assert taken == [2], "the successor never took the term from a frozen predecessor"
        cancel(cur, uid)
    assert not ledger.get(uid).cancel_requested
    new.request_cancel(uid)  # the frozen one's row lock is gone with it
    assert ledger.get(uid).cancel_requested


def test_a_predecessor_frozen_while_its_statement_waits_for_a_lock_does_not_hold_the_term_for_ever(replicas, ledger):
    """The frozen leader's statement is queued behind a row lock that someone else's forgotten
    transaction holds (an administrator's psql): it is not idle, so only the lock timeout ends its
    wait; then its aborted transaction is idle and ended too."""
    old, new = replicas
    old.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
    uid = admitted(old)
    frozen = psycopg.pq.PGconn.connect(ledger._dsn.encode())  # libpq itself: send, then never read
    try:
        with psycopg.connect(ledger._dsn) as forgotten:
            forgotten.execute("SELECT 1 FROM retex.tasks WHERE uid = %s FOR UPDATE", (uid,))  # and never ends
            for name, value in LIMITS.settings().items():  # the operator's session
                frozen.exec_(f"SET {name} = '{value}'".encode())
            # What a fenced request_cancel sends; the process then freezes and never reads the answer.
            frozen.send_query(f"BEGIN; SELECT term FROM retex.leadership FOR SHARE; "
                              f"SELECT * FROM retex.tasks WHERE uid = '{uid}' FOR UPDATE".encode())
            wait_until(lambda: waiting_for_a_lock(ledger))  # queued behind the forgotten row lock
            assert take_until_taken(new) == 2
    finally:
        frozen.finish()


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within 5 s"
        time.sleep(0.02)


def waiting_for_a_lock(ledger: Ledger) -> bool:
    with psycopg.connect(ledger._dsn) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                            " AND datname = current_database()").fetchone()[0] == 1


def take_until_taken(ledger: Ledger) -> int:
    """What the operator does: try again after each lock timeout."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return ledger.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
        except psycopg.errors.LockNotAvailable:
            if time.monotonic() > deadline:
                raise


def test_a_leaders_sessions_end_idle_transactions_and_probe_their_peer(replicas, ledger):
    settings = ("idle_in_transaction_session_timeout", "lock_timeout", "tcp_keepalives_idle",
                "tcp_keepalives_interval", "tcp_keepalives_count")

    def shown(of: Ledger) -> list[str]:
        with of._pool.connection() as conn:
            return [conn.execute("SELECT current_setting(%s)", (name,)).fetchone()[0] for name in settings]

    fenced, _ = replicas
    assert shown(fenced) == ["1s", "1s", "1", "1", "3"]
    assert shown(ledger)[:2] == ["0", "0"]  # a Ledger made without limits (the CLI's): the server's defaults


def test_an_unfenced_ledger_writes_whatever_the_term_the_administrators_cli(replicas, ledger):
    leader, _ = replicas
    leader.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
    uid = admitted(leader)
    ledger.request_cancel(uid, actor="cli:admin")  # `ledger`: made without leader_fenced, as the CLI's
    assert ledger.get(uid).cancel_requested


def test_a_replica_deposed_while_it_waited_takes_no_term(replicas, ledger):
    """The race: the old leader asked leading(), paused, and its successor took the term.
    Asked again under the term's lock, it takes none: the successor's term stays the ledger's."""
    old, new = replicas
    assert old.take_term(lock_timeout_seconds=TAKE_TIMEOUT) == 1
    assert new.take_term(lock_timeout_seconds=TAKE_TIMEOUT) == 2
    with pytest.raises(NotLeader, match="no longer leads"):
        old.take_term(lock_timeout_seconds=TAKE_TIMEOUT, still_leading=lambda: False)
    admitted(new)  # the successor still writes


def test_no_term_is_taken_between_the_leading_answer_and_the_increment(replicas, ledger):
    """A replica that answered "leading" holds the term's row lock until its increment commits: a
    successor's take waits for it and comes after, so the successor holds the ledger's term."""
    first, second = replicas
    taken: dict[str, int] = {}

    def successor_takes() -> None:
        taken["second"] = second.take_term(lock_timeout_seconds=5)

    thread = threading.Thread(target=successor_takes)

    def answer_then_pause() -> bool:
        thread.start()
        time.sleep(0.5)  # the successor's take starts meanwhile: it must wait for this one
        return True

    taken["first"] = first.take_term(lock_timeout_seconds=TAKE_TIMEOUT, still_leading=answer_then_pause)
    thread.join()
    assert taken == {"first": 1, "second": 2}
    admitted(second)
    with pytest.raises(NotLeader):
        first.admit(admission())



def test_a_live_leaders_transaction_cut_for_sitting_idle_is_no_loss_of_leadership(replicas, ledger):
    """A leader that stalled inside a write transaction past the session's limit has it ended by
    the server: nobody took the term, so that is a retryable LedgerUnavailable (the loops count
    it), not NotLeader; the leader goes on writing."""
    leader, _ = replicas
    leader.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
    uid = admitted(leader)
    with pytest.raises(LedgerUnavailable, match="sat idle"), writing(leader) as cur:
        time.sleep(1.5)
        cancel(cur, uid)
    leader.promote_due()


def test_a_transaction_cut_for_sitting_idle_after_a_successor_took_the_term_is_not_leader(replicas, ledger):
    old, new = replicas
    old.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
    uid = admitted(old)
    with pytest.raises(NotLeader), writing(old) as cur:
        time.sleep(1.5)  # the server ends it after 1 s; the successor takes the term
        new.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
        cancel(cur, uid)


def run_limits(ledger: Ledger) -> tuple[int | None, int | None]:
    with psycopg.connect(ledger._dsn) as conn:
        return conn.execute("SELECT max_running, max_running_per_namespace FROM retex.run_limits").fetchone()


def test_the_run_limits_are_the_leaders_a_standbys_other_setting_changes_nothing(replicas, ledger):
    leader, standby = replicas
    leader.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
    leader.set_run_limits(max_running=3, max_running_per_namespace=None)
    with pytest.raises(NotLeader):
        standby.set_run_limits(max_running=7, max_running_per_namespace=2)  # started with other settings
    assert run_limits(ledger) == (3, None)
    standby.take_term(lock_timeout_seconds=TAKE_TIMEOUT)  # it leads now: its settings are the ledger's
    standby.set_run_limits(max_running=7, max_running_per_namespace=2)
    assert run_limits(ledger) == (7, 2)


def test_a_purge_ends_at_the_first_batch_after_its_leadership_is_lost_and_keeps_the_batches_before(
        replicas, ledger, monkeypatch):
    leader, successor = replicas
    leader.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
    finished = []
    for _ in range(5):
        uid = admitted(leader, steps=("only",))
        run_all_steps(leader, uid, 1)
        leader.complete_task(uid, 1, actor="worker")
        finished.append(uid)
    time.sleep(0.01)
    submitted = ledger.figures().submitted
    checks = []
    check_term = transactions.check_term

    def successor_takes_over_before_the_second_batch(cur, term):
        checks.append(term)
        if len(checks) == 2:  # the first batch committed: nothing of the purge holds the term now
            successor.take_term(lock_timeout_seconds=TAKE_TIMEOUT)
        check_term(cur, term)

    monkeypatch.setattr(transactions, "check_term", successor_takes_over_before_the_second_batch)
    with pytest.raises(NotLeader):
        leader.purge_finished(older_than_seconds=0, batch=2)
    assert len(checks) == 2, "the purge went on after its leadership was lost"
    with psycopg.connect(ledger._dsn) as conn:
        left = {uid for (uid,) in conn.execute("SELECT uid FROM retex.tasks")}
    assert len(left) == 3 and left < set(finished), "the first batch of 2 went, nothing after it"
    assert ledger.figures().submitted == submitted  # the batch that went left its tallies
