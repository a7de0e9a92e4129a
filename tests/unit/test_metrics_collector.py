"""The metrics page's ledger figures (retex.operator.metrics.LedgerCollector) without a database:
a scrape waits a bounded time for the ledger, scrapes share one read, and only a database failure
reads as the ledger down."""

from __future__ import annotations

import threading

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from retex.ledger import DURATION_BUCKETS, Histogram, LedgerFigures, LedgerUnavailable
from retex.operator.metrics import LedgerCollector


class FakeLedger:
    """`figures` answers with `answer` (or raises it), once `release` is set (it is, unless a test
    clears it); `entered` is set when a read has begun."""

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
    return LedgerFigures(tasks_by_phase={}, dead_lettered=0, frozen=0, outbox_lag_seconds=0.0, deadline_overrun_seconds=0.0,
                         submitted=submitted, finished_by_phase={}, dead_lettered_ever=0, attempts_by_cause={},
                         step_seconds=seconds, task_seconds=seconds, first_step_seconds=seconds)


def page(collector: LedgerCollector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_a_scrape_answers_without_the_ledger_when_its_read_hangs_past_the_wait_and_the_read_goes_on():
    ledger = FakeLedger(figures(submitted=7))
    ledger.release.clear()  # the read hangs (a locked table, a silent server) until released
    collector = LedgerCollector(ledger, cache_seconds=60, wait_seconds=0)
    text = page(collector)
    assert "retex_ledger_up 0.0" in text and "retex_tasks_submitted" not in text
    ledger.entered.wait()
    assert "retex_ledger_up 0.0" in page(collector) and ledger.reads == 1, "one read at a time"
    ledger.release.set()
    collector._wait_seconds = 10  # the hung read ends now; the next scrape waits for it, then has it
    text = page(collector)
    assert "retex_ledger_up 1.0" in text and "retex_tasks_submitted_total 7.0" in text and ledger.reads == 1


def test_scrapes_during_a_read_wait_for_that_read_rather_than_start_another():
    ledger = FakeLedger(figures(submitted=7))
    ledger.release.clear()
    collector = LedgerCollector(ledger, cache_seconds=60)
    pages: list[str] = []
    scrapes = [threading.Thread(target=lambda: pages.append(page(collector))) for _ in range(3)]
    for scrape in scrapes:
        scrape.start()
    ledger.entered.wait()
    ledger.release.set()
    for scrape in scrapes:
        scrape.join()
    assert ledger.reads == 1 and len(pages) == 3
    assert all("retex_tasks_submitted_total 7.0" in text for text in pages)


@pytest.mark.parametrize("failure", [psycopg.errors.LockNotAvailable("lock timeout"),
                                     psycopg.errors.QueryCanceled("statement timeout"),
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
