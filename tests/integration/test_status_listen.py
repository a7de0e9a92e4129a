"""The operator's NOTIFY listener is supervised: whatever ends its connection or its loop (the
listening backend terminated, a payload it cannot read), it listens again and later changes still
mark their task for the status mirror, and the resync runs for the changes made meanwhile."""

import threading
import time

import psycopg
import pytest

from retex.operator.mirror import StatusMirror
from tests.integration.ledger_helpers import admitted


def wait_until(condition, *, timeout=20.0, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout}s"
        time.sleep(0.05)


def listening_backends(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [row[0] for row in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'")]


def kill_listener(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        for pid in listening_backends(dsn):
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))


def unreadable_payload(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("NOTIFY retex_ledger, 'not a uid and version'")


class WakeSeen(threading.Event):
    """The resync's wake, recording whether the listener was listening again when it was set."""

    def __init__(self, listening_again):
        super().__init__()
        self._listening_again, self.listening_when_set = listening_again, []

    def set(self):
        self.listening_when_set.append(self._listening_again())
        super().set()


@pytest.mark.parametrize("fault", [kill_listener, unreadable_payload], ids=["backend-terminated", "bad-payload"])
def test_notify_handling_survives_a_fault_in_the_listener(ledger, dsn, monkeypatch, fault):
    mirror = StatusMirror(ledger, kube=None, leases=None, resync_seconds=3600)  # listen needs the ledger only
    marked = []
    monkeypatch.setattr(mirror, "mark", marked.append)
    thread = threading.Thread(target=mirror.listen, args=(lambda: None,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: listening_backends(dsn), what="listening")
        first = admitted(ledger)
        wait_until(lambda: first in marked, what="the first change marked")
        before = set(listening_backends(dsn))
        mirror.resync.wake = WakeSeen(lambda: bool(set(listening_backends(dsn)) - before))
        fault(dsn)
        # A change made while nobody listens is the periodic resync's; this one comes after.
        wait_until(lambda: set(listening_backends(dsn)) - before, what="listening again")
        second = admitted(ledger)
        wait_until(lambda: second in marked, what="a change after the fault marked")
        # Once listening again, not before: a change made between a resync's read and the LISTEN
        # would go unheard until the next resync.
        assert mirror.resync.wake.listening_when_set == [True], "the resync finds what went unheard"
    finally:
        mirror.stop()
        thread.join(timeout=5)
