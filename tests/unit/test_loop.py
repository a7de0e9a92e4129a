"""What every operator loop shares: a round runs again at once when woken, stop() ends the loop
even in a long pause, and a round that raises (the ledger away, the API server refusing, a bug) is
counted and retried rather than ending the loop."""

import threading
import time

import pytest

from retex.kube.operator_calls import NotLeading
from retex.ledger import LedgerUnavailable, NotLeader
from retex.operator import loop as loop_module
from retex.operator.loop import Loop
from retex.operator.metrics import REGISTRY

LONG = 3600.0  # a round's own interval: far longer than any wait below


def failed_rounds(name: str) -> float:
    return REGISTRY.get_sample_value("retex_reconcile_errors_total", {"loop": name}) or 0.0


class Rounds(Loop):
    """Runs the scripted rounds in turn (an exception is raised, a number returned as the delay),
    then returns LONG; `ran` counts rounds and `rounds_done` signals each one."""

    name = "test-loop"

    def __init__(self, *script):
        super().__init__()
        self._script = list(script)
        self.ran = 0
        self._cond = threading.Condition()

    def round(self) -> float:
        with self._cond:
            self.ran += 1
            self._cond.notify_all()
        step = self._script.pop(0) if self._script else LONG
        if isinstance(step, Exception):
            raise step
        return step

    def wait_for_rounds(self, n: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.ran >= n, timeout=timeout)


@pytest.fixture
def running():
    started = []

    def start(loop: Loop) -> threading.Thread:
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        started.append((loop, thread))
        return thread

    yield start
    for loop, thread in started:
        loop.stop()
        thread.join(timeout=5)


def test_a_woken_loop_runs_its_next_round_at_once_not_after_its_interval(running):
    loop = Rounds(LONG)
    running(loop)
    assert loop.wait_for_rounds(1)
    loop.wake.set()
    assert loop.wait_for_rounds(2), "the wake did not cut the pause short"


def test_stop_ends_the_loop_during_a_long_pause_without_another_round(running):
    loop = Rounds(LONG)
    thread = running(loop)
    assert loop.wait_for_rounds(1)
    loop.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert loop.ran == 1


def test_a_loop_stopped_before_it_starts_runs_no_round():
    loop = Rounds()
    loop.stop()
    loop.run()  # returns at once
    assert loop.ran == 0


@pytest.mark.parametrize("error", [RuntimeError("a bug"), LedgerUnavailable("postgres down")],
                         ids=["any-exception", "ledger-unavailable"])
def test_a_round_that_raises_is_counted_and_retried_and_the_loop_goes_on(running, monkeypatch, error):
    monkeypatch.setattr(loop_module, "RETRY_AFTER_FAILURE_SECONDS", 0.01)
    before = failed_rounds(Rounds.name)
    loop = Rounds(error, error, LONG)
    thread = running(loop)
    assert loop.wait_for_rounds(3), "a failed round ended the loop"
    assert thread.is_alive()
    assert failed_rounds(Rounds.name) - before == 2


def test_a_loop_runs_no_round_while_it_may_not_write_and_runs_once_it_may(running, monkeypatch):
    monkeypatch.setattr(loop_module, "FOLLOWER_RECHECK_SECONDS", 0.01)
    leading = threading.Event()
    loop = Rounds(LONG)
    loop.may_write = leading.is_set  # a standby
    running(loop)
    assert not loop.wait_for_rounds(1, timeout=0.3), "a standby's loop ran a round"
    leading.set()
    assert loop.wait_for_rounds(1), "the leader's loop never ran"


def test_a_leader_past_its_deadline_starts_no_further_round(running, monkeypatch):
    monkeypatch.setattr(loop_module, "FOLLOWER_RECHECK_SECONDS", 0.01)
    leading = threading.Event()
    leading.set()
    loop = Rounds(0.01)
    loop.may_write = leading.is_set
    running(loop)
    assert loop.wait_for_rounds(1)
    leading.clear()  # the renew deadline passed during the round
    ran = loop.ran
    loop.wake.set()
    assert not loop.wait_for_rounds(ran + 1, timeout=0.3), "a round ran after leadership was lost"


@pytest.mark.parametrize("refusal", [NotLeader("the ledger's leadership term is 2, this writer's is 1"),
                                     NotLeading("create Job shop/order-1-1")], ids=["ledger-term", "kube-write"])
def test_a_round_refused_because_this_replica_stopped_leading_ends_quietly_not_as_a_failure(running, monkeypatch,
                                                                                         refusal):
    monkeypatch.setattr(loop_module, "FOLLOWER_RECHECK_SECONDS", 0.01)
    before = failed_rounds(Rounds.name)
    loop = Rounds(refusal, LONG)
    thread = running(loop)
    assert loop.wait_for_rounds(2), "the loop did not go on to ask may_write again"
    assert thread.is_alive()
    assert failed_rounds(Rounds.name) == before


class Blocking(Loop):
    """A round that holds until released: what the probes see of a round under way."""

    name = "blocking-loop"

    def __init__(self, outcome: Exception | None = None):
        super().__init__()
        self.entered, self.release, self._outcome = threading.Event(), threading.Event(), outcome

    def round(self) -> float:
        self.entered.set()
        self.release.wait(10)
        if self._outcome is not None:
            raise self._outcome
        return LONG


def test_a_round_under_way_shows_its_start_and_a_completed_one_moves_the_last_pass(running):
    loop = Blocking()
    passed_before = loop.last_pass_at
    running(loop)
    assert loop.entered.wait(5)
    assert loop.round_started_at is not None  # what the liveness probe times
    assert loop.last_pass_at == passed_before
    loop.release.set()
    assert wait_until(lambda: loop.round_started_at is None)
    assert loop.last_pass_at > passed_before  # what the readiness probe times


def test_a_failed_round_is_not_a_pass(running, monkeypatch):
    monkeypatch.setattr(loop_module, "RETRY_AFTER_FAILURE_SECONDS", LONG)
    loop = Blocking(LedgerUnavailable("postgres down"))
    passed_before = loop.last_pass_at
    running(loop)
    assert loop.entered.wait(5)
    loop.release.set()
    assert wait_until(lambda: loop.round_started_at is None)
    assert loop.last_pass_at == passed_before


def test_a_standby_passes_without_a_round(running, monkeypatch):
    monkeypatch.setattr(loop_module, "FOLLOWER_RECHECK_SECONDS", 0.01)
    loop = Rounds(LONG)
    loop.may_write = lambda: False
    passed_before = loop.last_pass_at
    running(loop)
    assert wait_until(lambda: loop.last_pass_at > passed_before), "an idle standby's loop looks stale"
    assert loop.ran == 0 and loop.round_started_at is None


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False
