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


def test_a_new_leadership_begun_as_an_earlier_taker_marks_its_term_is_not_marked_as_holding_it(monkeypatch):
    rt: Any = object.__new__(Runtime)
    rt.ledger = TermLedger()
    rt.leadership = types.SimpleNamespace(timing=types.SimpleNamespace(retry_period=0.1), identity="x",
                                          leading=lambda: True)
    rt._term_taken, rt._writers, rt._leaderships = threading.Event(), [], 1
    rt._leaderships_lock = threading.Lock()

    def new_leadership() -> None:  # what Runtime._lead does as this replica becomes leader again
        with rt._leaderships_lock:
            rt._term_taken.clear()
            rt._leaderships += 1

    real_event = handlers.event

    def event(logger: Any, level: int, message: str, **fields: Any) -> None:
        if message.startswith("ledger term taken"):  # between taker 1's check and its mark
            other = threading.Thread(target=new_leadership)
            other.start()
            other.join(timeout=0.5)
        real_event(logger, level, message, **fields)

    monkeypatch.setattr(handlers, "event", event)
    rt._take_term(1)
    while rt._leaderships != 2:  # the new leadership waited for taker 1 to finish marking
        threading.Event().wait(0.01)
    assert not rt._term_taken.is_set(), "taker 1 marked leadership 2 as holding the term"
