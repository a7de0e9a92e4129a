"""The Runtime's taking of the ledger's leadership term (retex.operator.handlers.Runtime._take_term)
on a real ledger: a replica deposed between its "leading" answer and its increment takes no term
after its successor's."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from retex.ledger import Ledger, NotLeader
from retex.ledger.transactions import SessionLimits
from retex.operator.handlers import Runtime

LIMITS = SessionLimits(idle_in_transaction_seconds=1.0, lock_timeout_seconds=1.0)


class FakeLeadership:
    def __init__(self, leading: Callable[[], bool]):
        self._leading = leading
        self.timing = types.SimpleNamespace(retry_period=0.1, lease_duration=1.0)
        self.identity = "x"
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1

    def leading(self) -> bool:
        return self._leading()


def runtime(ledger: Ledger, leading: Callable[[], bool], *, max_running: int | None = None,
            max_running_per_namespace: int | None = None) -> Any:
    rt: Any = object.__new__(Runtime)
    rt.ledger, rt.leadership = ledger, FakeLeadership(leading)
    rt._term_taken, rt._writers, rt._leaderships = threading.Event(), [], 1
    rt._leaderships_lock = threading.Lock()
    rt._term_wanted_since = None
    rt._max_running, rt._max_running_per_namespace = max_running, max_running_per_namespace
    rt.mirror = types.SimpleNamespace(mark_behind=lambda **_: None)  # no Task to compare with the ledger
    return rt


def run_limits(dsn: str) -> tuple[int | None, int | None]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT max_running, max_running_per_namespace FROM retex.run_limits").fetchone()
    assert row is not None
    return row[0], row[1]


def ledger_term(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT term FROM retex.leadership").fetchone()
    assert row is not None
    return int(row[0])


def test_a_replica_deposed_after_its_leading_check_does_not_depose_its_successor(dsn, ledger):
    with (Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as la,
          Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as lb):
        a_leads = [True]
        a = runtime(la, lambda: a_leads[0])
        paused, resume = threading.Event(), threading.Event()
        real_take = la.take_term

        def take_after_pause(**kw: Any) -> int:  # A freezes right after its `while leading()` check
            paused.set()
            resume.wait()
            return real_take(**kw)

        la.take_term = take_after_pause  # type: ignore[method-assign]
        ta = threading.Thread(target=a._take_term, args=(1,))
        ta.start()
        assert paused.wait(5)
        a_leads[0] = False  # A's renew deadline passes while it is frozen; B takes over
        b = runtime(lb, lambda: True)
        b._take_term(1)
        assert b.may_write()
        lb.promote_due()
        resume.set()  # A resumes and goes on to take the term
        ta.join(5)
        assert not ta.is_alive() and not a.may_write()
        assert b.may_write()
        lb.promote_due()  # B still writes


def test_a_taker_left_over_from_an_earlier_leadership_marks_nothing(dsn, ledger):
    with Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as la:
        a = runtime(la, lambda: True)
        a._leaderships = 2  # this replica lost and took leadership again since taker 1 started
        a._take_term(1)
        assert not a.may_write()
        a._take_term(2)
        assert a.may_write()
        la.promote_due()


def test_a_leader_whose_term_moved_on_restarts_its_leadership_rather_than_take_the_term_itself(dsn, ledger):
    """Should the ledger's term move past a replica that still leads by its own clock (a host
    suspend stopped that clock; two installs share the database), a refused write stops its
    writing and restarts its leadership: the next term is taken only after a Lease write proved
    it still holds the Lease (Leadership.restart), never on that clock alone."""
    with (Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as la,
          Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as other):
        a = runtime(la, lambda: True)
        a._take_term(1)
        moved_on = other.take_term(lock_timeout_seconds=0.3)  # the term moves past A, which still leads
        with pytest.raises(NotLeader) as refused:
            la.promote_due()
        a._term_lost(refused.value)
        time.sleep(1.0)  # a term taker started here would have taken the term by now
        assert not a.may_write()
        assert ledger_term(dsn) == moved_on, "A took the term on its own clock"
        assert a.leadership.restarts == 1
        other.promote_due()  # the other still writes


def test_a_refusal_of_an_earlier_term_does_not_restart_the_leadership_again(dsn, ledger):
    """Two writers refused for the same lost term: the first restarts the leadership; the
    second's refusal, handled after the new term was taken, is of a term this replica no longer
    writes with, and restarts nothing."""
    with (Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as la,
          Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as other):
        a = runtime(la, lambda: True)
        a._take_term(1)
        other.take_term(lock_timeout_seconds=0.3)
        refusals = []
        for _ in range(2):  # two writers, each refused for A's first term
            with pytest.raises(NotLeader) as refused:
                la.promote_due()
            refusals.append(refused.value)
        a._term_lost(refusals[0])
        assert a.leadership.restarts == 1 and not a.may_write()
        a._leaderships = 2  # the restarted leadership's taker takes a new term
        a._take_term(2)
        assert a.may_write()
        a._term_lost(refusals[1])
        assert a.may_write(), "a refusal of the term before restarted the leadership again"
        assert a.leadership.restarts == 1
        la.promote_due()


def test_a_leader_that_cannot_take_the_term_for_a_lease_duration_may_not_keep_the_lease(dsn, ledger):
    """An old leader's long transaction holds the term's row: the new leader's taker keeps
    failing, and after a lease duration (1 s here) the election hears that it may not keep the
    Lease (Leadership gives it up then: tests/unit/test_leadership.py)."""
    with (Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as la,
          psycopg.connect(dsn) as old_leader):
        old_leader.execute("SELECT term FROM retex.leadership FOR SHARE")  # its transaction stays open
        a_leads = [True]
        a = runtime(la, lambda: a_leads[0])
        a._term_wanted_since = time.monotonic()  # what Runtime._lead sets as the leadership begins
        taker = threading.Thread(target=a._take_term, args=(1,), daemon=True)
        taker.start()
        time.sleep(0.3)
        assert not a.may_write() and a._may_keep_lease()
        time.sleep(1.0)
        assert not a.may_write()
        waited = a._waiting_for_term()
        assert waited is not None and waited >= 1.0
        assert not a._may_keep_lease()
        a_leads[0] = False  # it gave the Lease up: the taker stops
        taker.join(3)
        assert not taker.is_alive()
        assert a._waiting_for_term() is None
        old_leader.rollback()


def test_a_replica_writes_its_run_limits_under_the_term_it_takes_before_its_writers_wake(dsn, ledger):
    """RETEX_MAX_RUNNING and RETEX_MAX_RUNNING_PER_NAMESPACE are the leader's: a replica writes
    its own as it takes the term, and a writer it wakes places tasks under them."""
    with (Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as la,
          Ledger(dsn, retry_for_seconds=2, limits=LIMITS, leader_fenced=True) as lb):
        seen_by_writers: list[tuple[int | None, int | None]] = []
        writer = types.SimpleNamespace(wake=types.SimpleNamespace(set=lambda: seen_by_writers.append(run_limits(dsn))))
        a = runtime(la, lambda: True, max_running=3)
        a._writers = [writer]
        a._take_term(1)
        assert run_limits(dsn) == (3, None)
        assert seen_by_writers == [(3, None)], "a writer woke before the leader's limits were written"
        b = runtime(lb, lambda: True, max_running=7, max_running_per_namespace=2)  # takes over
        b._take_term(1)
        assert run_limits(dsn) == (7, 2)
        with pytest.raises(NotLeader):
            la.set_run_limits(max_running=3, max_running_per_namespace=None)  # the deposed leader's
        assert run_limits(dsn) == (7, 2)


def test_a_leaderships_writers_wait_until_every_task_was_compared_with_the_ledger(dsn, ledger):
    """The sweep that freezes Tasks showing more than the ledger holds runs under the new term and
    before the term counts as taken (the writers start then): a ledger restored while no leader
    watched dispatches nothing first. A sweep that fails (the API server away) is tried again."""
    with Ledger(dsn, limits=LIMITS, leader_fenced=True) as fenced:
        a = runtime(fenced, lambda: True)
        compared: list[bool] = []

        def mark_behind(**given: Any) -> None:
            compared.append(a._term_taken.is_set())
            assert given.get("lost") == a._judge_lost, "the Tasks the ledger lost are judged too, before kopf admits"
            if len(compared) == 1:
                raise ConnectionError("the API server went away")

        a.mirror = types.SimpleNamespace(mark_behind=mark_behind)
        a._take_term(1)

    assert compared == [False, False], "tried again after a failure, each time before the term counted as taken"
    assert a._term_taken.is_set()

