"""The Runtime's term taker (retex.operator.handlers.Runtime._take_term) on a stand-in ledger:
a taker of an earlier leadership never marks a later one as holding the term."""

from __future__ import annotations

import threading
import types
from typing import Any

from retex.operator import handlers
from retex.operator.handlers import Runtime


class TermLedger:
    term = 7

    def take_term(self, **_: Any) -> int:
        return self.term

    def set_run_limits(self, **_: Any) -> None:
        """Written under the term just taken."""


def runtime(ledger: TermLedger, leading: Any, *, retry_period: float, lease_duration: float = 15) -> Any:
    """A Runtime with only what `_take_term` uses, in its first leadership."""
    rt: Any = object.__new__(Runtime)
    rt.ledger = ledger
    rt.leadership = types.SimpleNamespace(
        timing=types.SimpleNamespace(retry_period=retry_period, lease_duration=lease_duration),
        identity="x", leading=leading)
    rt._term_taken, rt._writers, rt._leaderships = threading.Event(), [], 1
    rt._leaderships_lock = threading.Lock()
    rt._term_wanted_since = 0.0
    rt._max_running = rt._max_running_per_namespace = None
    rt.mirror = types.SimpleNamespace(mark_behind=lambda **_: None)  # no Task to compare with the ledger
    return rt


def test_a_new_leadership_begun_as_an_earlier_taker_marks_its_term_is_not_marked_as_holding_it(monkeypatch):
    rt = runtime(TermLedger(), lambda: True, retry_period=0.1)

    def new_leadership() -> None:  # what Runtime._lead does as this replica becomes leader again
        with rt._leaderships_lock:
            rt._term_taken.clear()
            rt._leaderships += 1

    real_log_line = handlers.log_line

    def log_line(logger: Any, level: int, message: str, **fields: Any) -> None:
        if message.startswith("ledger term taken"):  # between taker 1's check and its mark
            other = threading.Thread(target=new_leadership)
            other.start()
            other.join(timeout=0.5)
        real_log_line(logger, level, message, **fields)

    monkeypatch.setattr(handlers, "log_line", log_line)
    rt._take_term(1)
    while rt._leaderships != 2:  # the new leadership waited for taker 1 to finish marking
        threading.Event().wait(0.01)
    assert not rt._term_taken.is_set(), "taker 1 marked leadership 2 as holding the term"


def test_a_taker_whose_leadership_lapses_for_a_moment_still_takes_the_term_when_it_goes_on():
    """A renewal sent before the renew deadline and answered after it continues the leadership
    (the election judges a RENEW by when it began), though `leading()` said no meanwhile: the
    taker must not have quit, or this leadership would go on without a term."""
    answers = iter([False, False])  # leading(): no for a moment, then yes for good

    class CountingLedger(TermLedger):
        taken = 0

        def take_term(self, **kwargs: Any) -> int:
            assert kwargs["still_leading"](), "asked to take the term while not leading"
            self.taken += 1
            return self.term

    rt = runtime(CountingLedger(), lambda: next(answers, True), retry_period=0.01)
    rt._take_term(1)
    assert rt._term_taken.is_set() and rt.ledger.taken == 1


def test_a_taker_whose_leadership_does_not_lead_for_a_lease_duration_quits_without_a_term():
    rt = runtime(TermLedger(), lambda: False, retry_period=0.01, lease_duration=0.05)
    rt._take_term(1)  # returns: a deposed replica's taker does not wait for ever
    assert not rt._term_taken.is_set()
