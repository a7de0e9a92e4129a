"""The operator's metrics as Prometheus reads them, rendered from a real ledger and parsed with
prometheus_client's OpenMetrics parser (strict: a name exported as two families, e.g. a gauge and
a counter, is an error): one type per family, counters named `_total`, no name twice, and no
counter or histogram count going down across a requeue and a purge."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import psycopg
import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from e2e.postgres import free_port
from retex.operator.metrics import REGISTRY, LedgerCollector, metrics_ledger
from tests.integration.ledger_helpers import admitted, run_all_steps
from tests.integration.test_status_listen import wait_until


def families(ledger) -> list:
    """Every family the operator exports, ledger-derived and process-local, parsed as one page."""
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger, cache_seconds=0))
    page = generate_latest(REGISTRY).decode().removesuffix("# EOF\n") + generate_latest(registry).decode()
    return list(text_string_to_metric_families(page))


def counts(ledger) -> dict[tuple[str, tuple], float]:
    """Every sample that must never go down: counters' `_total` and histograms' `_count`/`_sum`/`_bucket`."""
    monotonic = {}
    for family in families(ledger):
        if family.type not in ("counter", "histogram"):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_total", "_count", "_sum", "_bucket")):
                monotonic[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return monotonic


def test_every_family_has_one_type_and_counters_end_in_total(ledger):
    parsed = families(ledger)  # the strict parser raises on a name exported twice
    names = [family.name for family in parsed]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    exported = {sample.name for family in parsed for sample in family.samples}
    for family in parsed:
        assert family.type in ("counter", "gauge", "histogram"), (family.name, family.type)
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
            assert f"{family.name}_total" in exported or not family.samples
        else:
            assert not family.name.endswith("_total"), f"{family.name} is a {family.type} named like a counter"
    assert "retex_dead_lettered_tasks" in names and "retex_tasks_dead_lettered" in names


def test_no_counter_decreases_across_a_requeue_and_a_purge(ledger):
    dead = admitted(ledger, steps=("only",), max_attempts=1)
    ledger.begin_step(dead, 1, 0, actor="worker")
    ledger.fail_step(dead, 1, 0, "boom", retryable=True, actor="worker")  # budget spent: dead-lettered
    done = admitted(ledger, steps=("only",))
    run_all_steps(ledger, done, 1)
    ledger.complete_task(done, 1, actor="worker")
    before = counts(ledger)
    assert before[("retex_tasks_dead_lettered_total", ())] == 1
    assert before[("retex_tasks_finished_total", (("outcome", "failed"),))] == 1

    ledger.requeue(dead, actor="cli:alice")  # Failed and dead-lettered no more
    after_requeue = counts(ledger)
    run_all_steps(ledger, dead, 2)
    ledger.complete_task(dead, 2, actor="worker")
    time.sleep(0.01)
    assert ledger.purge_finished(older_than_seconds=0) == 2  # every row of both tasks goes
    after_purge = counts(ledger)

    for earlier, later, what in ((before, after_requeue, "requeue"), (after_requeue, after_purge, "purge")):
        fell = {key: (earlier[key], later.get(key)) for key in earlier if later.get(key, 0) < earlier[key]}
        assert not fell, f"counters went down across the {what}: {fell}"
    assert after_purge[("retex_tasks_submitted_total", ())] == 2
    assert after_purge[("retex_tasks_finished_total", (("outcome", "failed"),))] == 1
    assert after_purge[("retex_tasks_finished_total", (("outcome", "succeeded"),))] == 2
    assert after_purge[("retex_tasks_dead_lettered_total", ())] == 1
    assert after_purge[("retex_attempts_started_total", (("cause", "requeue"),))] == 1
    assert after_purge[("retex_step_duration_seconds_count", ())] == 3  # failed, then two commits
    assert after_purge[("retex_task_duration_seconds_count", ())] == 3  # each time a task ended
    gauges = {s.name: s.value for f in families(ledger) if f.type == "gauge" for s in f.samples}
    assert gauges["retex_dead_lettered_tasks"] == 0  # the state now: requeued, then purged


def test_a_task_left_unfinished_past_its_deadline_shows_until_the_promoter_fails_it(ledger):
    def overrun() -> float:
        return next(s.value for f in families(ledger) for s in f.samples if s.name == "retex_task_deadline_overrun_seconds")

    uid = admitted(ledger, steps=("only",), timeout_seconds=1)  # the deadline runs from the first start
    assert overrun() == 0
    time.sleep(1.6)
    assert 0.5 < overrun() < 30, "the running task is past its deadline and nobody failed it yet"
    ledger.promote_due()  # what the promoter does each round: fails it with reason Timeout
    assert str(ledger.get(uid).phase) == "Failed" and overrun() == 0


def scrape(ledger, timeout: float = 60) -> tuple[int, str]:
    """The operator's /metrics page over HTTP, as Prometheus reads it: the process families and
    the ledger's, one page (retex.operator.metrics.serve)."""
    collector = LedgerCollector(ledger, cache_seconds=0)
    REGISTRY.register(collector)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=REGISTRY)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        REGISTRY.unregister(collector)


def test_during_a_postgres_outage_the_page_still_answers_with_ledger_up_0_and_retex_leader(own_postgres):
    with psycopg.connect(own_postgres.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE metrics_outage")
    dsn = own_postgres.dsn(dbname="metrics_outage")
    with metrics_ledger(dsn) as ledger:
        before = scrape(ledger)
        own_postgres.stop()
        with pytest.raises(psycopg.OperationalError):  # the fault fired: Postgres refuses us
            psycopg.connect(dsn, connect_timeout=2).close()
        during = scrape(ledger)
        own_postgres.start()
        after = scrape(ledger)
    # The process families stay (retex_leader: RetexNoLeader must not fire for an outage); the
    # ledger's are left out rather than shown stale or as zeros.
    status, page = during
    assert status == 200, page
    assert "retex_ledger_up 0.0" in page and "retex_leader " in page and "retex_loop_rounds_total" in page
    assert "retex_tasks{" not in page and "retex_outbox_lag_seconds" not in page
    for status, page in (before, after):
        assert status == 200 and "retex_ledger_up 1.0" in page and "retex_tasks{" in page, page


def test_while_a_migration_holds_the_tasks_table_the_page_answers_at_once_with_ledger_up_0(ledger, dsn):
    """A query that hangs (here: waiting on a lock, as behind a migration's ALTER TABLE) must not
    hang the scrape: the page answers within Prometheus' default scrape timeout (10 s), and the
    read itself gives up (lock_timeout) rather than hold a session queued behind the lock."""
    with metrics_ledger(dsn) as scraped, psycopg.connect(dsn) as migration:
        assert "retex_ledger_up 1.0" in scrape(scraped, timeout=10)[1]
        migration.execute("LOCK TABLE retex.tasks IN ACCESS EXCLUSIVE MODE")  # held until rollback
        try:
            status, page = scrape(scraped, timeout=10)
            wait_until(lambda: metrics_sessions_waiting_on_a_lock(dsn) == 0, timeout=10,
                       what="the metrics read given up while the table is still locked")
        finally:
            migration.rollback()
    assert status == 200, page
    assert "retex_ledger_up 0.0" in page and "retex_leader " in page
    assert "retex_tasks{" not in page


def metrics_sessions_waiting_on_a_lock(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'retex-metrics' "
                            "AND wait_event_type = 'Lock'").fetchone()[0]
