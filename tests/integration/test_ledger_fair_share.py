"""Run slots shared between namespaces: the namespace with the fewest running attempts is served
first whatever the priorities its neighbours chose, and a namespace's own run limit (its
TaskPolicy's maxRunning, carried into the ledger by the operator's leader) is honoured with the
global ones."""

from collections import Counter

import psycopg
import pytest

from retex.ledger import Ledger, NotLeader
from tests.integration.ledger_helpers import admitted, run_all_steps


def running_by_namespace(ledger) -> Counter[str]:
    return Counter(task.namespace for task in ledger.running())


def finish(ledger, uid):
    record = ledger.get(uid)
    run_all_steps(ledger, uid, record.epoch)
    ledger.complete_task(uid, record.epoch, actor="worker")


def test_a_namespace_of_top_priority_tasks_leaves_another_namespace_its_share_as_slots_free(ledger):
    ledger.set_run_limits(max_running=4, max_running_per_namespace=None)
    noisy = [admitted(ledger, namespace="tenant-a", priority=1000, steps=("only",)) for _ in range(20)]
    quiet = [admitted(ledger, namespace="tenant-b", priority=0, steps=("only",)) for _ in range(4)]
    assert running_by_namespace(ledger) == {"tenant-a": 4}, "alone first, tenant-a took every slot"
    for _ in range(6):  # tenant-a's running tasks end one after another
        finish(ledger, next(task.uid for task in ledger.running() if task.namespace == "tenant-a"))
        assert sum(running_by_namespace(ledger).values()) == 4
    assert running_by_namespace(ledger) == {"tenant-a": 2, "tenant-b": 2}
    assert len([uid for uid in noisy if ledger.get(uid).phase == "Queued"]) == 20 - 6 - 2
    assert len([uid for uid in quiet if ledger.get(uid).phase == "Queued"]) == 2


def test_slots_opened_at_once_are_dealt_namespace_by_namespace(ledger):
    ledger.set_run_limits(max_running=1, max_running_per_namespace=None)
    for _ in range(20):
        admitted(ledger, namespace="tenant-a", priority=1000, steps=("only",))
    for _ in range(4):
        admitted(ledger, namespace="tenant-b", priority=0, steps=("only",))
    assert running_by_namespace(ledger) == {"tenant-a": 1}
    ledger.set_run_limits(max_running=4, max_running_per_namespace=None)
    assert running_by_namespace(ledger) == {"tenant-a": 2, "tenant-b": 2}


def test_within_a_namespace_priority_then_submission_decide_and_between_equals_submission(ledger):
    ledger.set_run_limits(max_running=1, max_running_per_namespace=None)
    blocker = admitted(ledger, namespace="tenant-a")
    other = admitted(ledger, namespace="tenant-b", priority=-1000)
    low = admitted(ledger, namespace="tenant-a", priority=-5)
    high = admitted(ledger, namespace="tenant-a", priority=50)
    finish(ledger, blocker)
    assert ledger.get(other).phase == "Running", "both run nothing: the task submitted first, whatever its priority"
    finish(ledger, other)
    assert [ledger.get(uid).phase for uid in (low, high)] == ["Queued", "Running"]


def test_a_namespace_run_limit_is_honoured_with_the_global_ones_and_raising_it_fills_slots(ledger):
    ledger.set_run_limits(max_running=5, max_running_per_namespace=None)
    ledger.set_namespace_run_limit("tenant-a", 1)
    a = [admitted(ledger, namespace="tenant-a") for _ in range(4)]
    b = [admitted(ledger, namespace="tenant-b") for _ in range(4)]
    assert running_by_namespace(ledger) == {"tenant-a": 1, "tenant-b": 4}
    ledger.set_namespace_run_limit("tenant-a", 3)  # raised: the slots it opened are filled at once
    assert running_by_namespace(ledger) == {"tenant-a": 1, "tenant-b": 4}, "the global limit still holds"
    finish(ledger, b[0])
    finish(ledger, b[1])
    assert running_by_namespace(ledger) == {"tenant-a": 3, "tenant-b": 2}
    ledger.set_run_limits(max_running=None, max_running_per_namespace=2)  # the smaller limit wins
    finish(ledger, next(uid for uid in a if ledger.get(uid).phase == "Running"))
    assert running_by_namespace(ledger)["tenant-a"] == 2
    ledger.set_namespace_run_limit("tenant-a", None)  # the TaskPolicy gone: only the global ones
    ledger.set_run_limits(max_running=None, max_running_per_namespace=None)
    assert running_by_namespace(ledger)["tenant-a"] == 3  # all of tenant-a's unfinished tasks


def test_replacing_the_namespace_run_limits_drops_the_namespaces_left_out(ledger):
    ledger.replace_namespace_run_limits({"tenant-a": 1, "tenant-b": 1})
    a = [admitted(ledger, namespace="tenant-a") for _ in range(2)]
    b = [admitted(ledger, namespace="tenant-b") for _ in range(2)]
    assert running_by_namespace(ledger) == {"tenant-a": 1, "tenant-b": 1}
    ledger.replace_namespace_run_limits({"tenant-b": 1})  # tenant-a's TaskPolicy was deleted meanwhile
    assert running_by_namespace(ledger) == {"tenant-a": 2, "tenant-b": 1}
    assert [ledger.get(uid).phase for uid in (*a, *b)] == ["Running", "Running", "Running", "Queued"]


def test_a_namespace_run_limit_is_the_leaders_write(dsn, ledger):
    with (Ledger(dsn, retry_for_seconds=5, leader_fenced=True) as old,
          Ledger(dsn, retry_for_seconds=5, leader_fenced=True) as new):
        old.take_term(lock_timeout_seconds=5)
        new.take_term(lock_timeout_seconds=5)
        with pytest.raises(NotLeader):
            old.set_namespace_run_limit("tenant-a", 1)
        with pytest.raises(NotLeader):
            old.replace_namespace_run_limits({"tenant-a": 1})
        new.set_namespace_run_limit("tenant-a", 2)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT namespace, max_running FROM retex.namespace_run_limits").fetchall() == [("tenant-a", 2)]
