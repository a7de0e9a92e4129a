"""Policies the ledger enforces for every process: concurrency keys, priorities, run limits,
task timeouts."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest

from retex.ledger import FenceRejected
from retex.machine import TaskPhase
from tests.integration.ledger_helpers import admission, admitted, run_all_steps


def phases(ledger, uids):
    return [ledger.get(uid).phase for uid in uids]


def finish(ledger, uid):
    record = ledger.get(uid)
    run_all_steps(ledger, uid, record.epoch)
    ledger.complete_task(uid, record.epoch, actor="worker")


def test_one_task_per_concurrency_key_runs_and_the_next_is_the_oldest_whatever_its_priority(ledger):
    first = admitted(ledger, concurrency_key="customer-7")
    second = admitted(ledger, concurrency_key="customer-7", priority=0)
    third = admitted(ledger, concurrency_key="customer-7", priority=100)
    other = admitted(ledger, concurrency_key="customer-8")
    assert phases(ledger, [first, second, third, other]) == ["Running", "Queued", "Queued", "Running"]
    finish(ledger, first)
    assert phases(ledger, [second, third]) == ["Running", "Queued"]


def test_fifo_follows_submission_time_not_the_order_the_operator_admitted_in(ledger):
    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    first = admitted(ledger, concurrency_key="k", submitted_at=t0)
    later = admitted(ledger, concurrency_key="k", submitted_at=t0 + timedelta(seconds=2))
    earlier = admitted(ledger, concurrency_key="k", submitted_at=t0 + timedelta(seconds=1))
    finish(ledger, first)
    assert phases(ledger, [earlier, later]) == ["Running", "Queued"]


def test_a_retrying_task_keeps_its_concurrency_key(ledger):
    first = admitted(ledger, concurrency_key="k")
    second = admitted(ledger, concurrency_key="k")
    ledger.begin_step(first, 1, 0, actor="worker")
    ledger.fail_step(first, 1, 0, "503", retryable=True, actor="worker")
    assert phases(ledger, [first, second]) == ["Retrying", "Queued"]


def test_at_capacity_the_higher_priority_task_starts_first(ledger):
    ledger.set_run_limits(max_running=1, max_running_per_namespace=None)
    running = admitted(ledger)
    low = admitted(ledger, priority=-5)
    high = admitted(ledger, priority=50)
    assert phases(ledger, [running, low, high]) == ["Running", "Queued", "Queued"]
    finish(ledger, running)
    assert phases(ledger, [low, high]) == ["Queued", "Running"]


def test_per_namespace_limits_leave_other_namespaces_running(ledger):
    ledger.set_run_limits(max_running=None, max_running_per_namespace=1)
    a1, a2 = admitted(ledger, namespace="a"), admitted(ledger, namespace="a")
    b1 = admitted(ledger, namespace="b")
    assert phases(ledger, [a1, a2, b1]) == ["Running", "Queued", "Running"]


def test_raising_the_limit_starts_queued_tasks(ledger):
    ledger.set_run_limits(max_running=1, max_running_per_namespace=None)
    uids = [admitted(ledger) for _ in range(3)]
    ledger.set_run_limits(max_running=3, max_running_per_namespace=None)
    assert phases(ledger, uids) == ["Running"] * 3


def test_a_burst_of_500_tasks_never_exceeds_the_limit_and_each_runs_exactly_once(ledger, dsn):
    import psycopg

    limit = 7
    ledger.set_run_limits(max_running=limit, max_running_per_namespace=None)
    with ThreadPoolExecutor(8) as pool:
        uids = list(pool.map(lambda _: ledger.admit(admission(steps=("only",))).uid, range(500)))
    peak = 0
    stop = threading.Event()

    def watch():
        nonlocal peak
        with psycopg.connect(dsn) as conn:
            while not stop.is_set():
                peak = max(peak, conn.execute("SELECT count(*) FROM retex.tasks WHERE phase = 'Running'").fetchone()[0])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        def drain(share):  # four "workers", each finishing its own share of the running tasks
            mine = set(uids[share::4])
            while mine:
                for task in ledger.running():
                    if task.uid in mine:
                        finish(ledger, task.uid)
                        mine.discard(task.uid)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(drain, range(4)))
    finally:
        stop.set()
        watcher.join()
    assert set(phases(ledger, uids)) == {TaskPhase.SUCCEEDED}
    assert 0 < peak <= limit
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM retex.attempts").fetchone()[0] == 500
        assert conn.execute("SELECT count(*) FROM retex.outbox").fetchone()[0] == 500


def test_a_task_past_its_timeout_fails_and_its_worker_is_fenced_out(ledger):
    uid = admitted(ledger, timeout_seconds=1)
    deadline = ledger.get(uid).deadline_at
    assert deadline is not None and ledger.next_due_at() == deadline
    ledger.begin_step(uid, 1, 0, actor="worker")
    time.sleep(1.1)
    ledger.promote_due()
    record = ledger.get(uid)
    assert (record.phase, record.reason) == (TaskPhase.FAILED, "Timeout")
    with pytest.raises(FenceRejected):
        ledger.commit_step(uid, 1, 0, "late", actor="worker")


def test_requeue_gives_a_fresh_timeout(ledger):
    uid = admitted(ledger, timeout_seconds=1)
    time.sleep(1.1)
    ledger.promote_due()
    requeued = ledger.requeue(uid, actor="cli:alice")
    assert requeued.phase == TaskPhase.RUNNING and requeued.deadline_at > requeued.created_at
