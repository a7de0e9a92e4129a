"""The metrics page's ledger figures (retex.operator.metrics.LedgerCollector) without a database:
one scrape's read never holds up another, and only a database failure reads as the ledger down."""

from __future__ import annotations

import threading

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from retex.ledger import DURATION_BUCKETS, Histogram, LedgerFigures, LedgerUnavailable
from retex.operator.metrics import LedgerCollector


class FakeLedger:
    """`figures` answers with `answer` (or raises it), after `release` is set once `entered` is."""

    def __init__(self, answer):
        self.answer = answer
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()
        self.reads = 0

    def ping(self, *, timeout: int) -> None:
        pass

    def figures(self) -> LedgerFigures:
        self.reads += 1
        self.entered.set()
        self.release.wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def figures(submitted: int) -> LedgerFigures:
    seconds = Histogram(count=0, total=0.0, cumulative=[0] * len(DURATION_BUCKETS))
    return LedgerFigures(tasks_by_phase={}, dead_lettered=0, outbox_lag_seconds=0.0, deadline_overrun_seconds=0.0,
                         submitted=submitted, finished_by_phase={}, dead_lettered_ever=0, attempts_by_cause={},
                         step_seconds=seconds, task_seconds=seconds, first_step_seconds=seconds)


def page(collector: LedgerCollector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_a_scrape_while_another_reads_is_answered_with_the_figures_read_last_without_waiting():
    ledger = FakeLedger(figures(submitted=7))
    collector = LedgerCollector(ledger, cache_seconds=0)
    assert "retex_tasks_submitted_total 7.0" in page(collector)
    ledger.answer, ledger.entered = figures(submitted=8), threading.Event()
    ledger.release.clear()  # the next read hangs (a locked table, a silent server) until released
    hung = threading.Thread(target=page, args=(collector,), daemon=True)
    hung.start()
    ledger.entered.wait()

    answered: list[str] = []
    meanwhile = threading.Thread(target=lambda: answered.append(page(collector)), daemon=True)
    meanwhile.start()
    meanwhile.join(timeout=10)  # only there to report the failure: it must not wait at all
    waited = meanwhile.is_alive()
    ledger.release.set()
    hung.join()
    assert not waited, "the second scrape waited for the first one's read"
    assert "retex_ledger_up 1.0" in answered[0] and "retex_tasks_submitted_total 7.0" in answered[0]
    assert ledger.reads == 2  # the second scrape started no read of its own
    assert "retex_tasks_submitted_total 8.0" in page(collector)


def test_before_any_read_finished_a_scrape_meanwhile_shows_the_ledger_down():
    ledger = FakeLedger(figures(submitted=7))
    ledger.release.clear()
    collector = LedgerCollector(ledger, cache_seconds=0)
    hung = threading.Thread(target=page, args=(collector,), daemon=True)
    hung.start()
    ledger.entered.wait()
    answered: list[str] = []
    meanwhile = threading.Thread(target=lambda: answered.append(page(collector)), daemon=True)
    meanwhile.start()
    meanwhile.join(timeout=10)
    waited = meanwhile.is_alive()
    ledger.release.set()
    hung.join()
    assert not waited, "the second scrape waited for the first one's read"
    assert "retex_ledger_up 0.0" in answered[0] and "retex_tasks_submitted" not in answered[0]


@pytest.mark.parametrize("failure", [psycopg.errors.LockNotAvailable("lock timeout"),
                                     psycopg.OperationalError("connection refused"),
                                     LedgerUnavailable("figures: Postgres unavailable for 2s")])
def test_a_database_failure_reads_as_the_ledger_down(failure):
    collector = LedgerCollector(FakeLedger(failure), cache_seconds=0)
    text = page(collector)
    assert "retex_ledger_up 0.0" in text and "retex_tasks_submitted" not in text


def test_a_bug_in_the_read_fails_the_scrape_rather_than_pass_for_the_ledger_down():
    ledger = FakeLedger(KeyError("tasks_by_phase"))
    collector = LedgerCollector(ledger, cache_seconds=60)
    with pytest.raises(KeyError):
        page(collector)
    with pytest.raises(KeyError):  # nothing cached: the next scrape reads again
        page(collector)
    assert ledger.reads == 2
