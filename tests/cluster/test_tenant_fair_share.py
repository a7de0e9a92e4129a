"""A namespace's share of retex, set by its TaskPolicy on the rig's real API server: `maxPriority`
caps the priority its Tasks may ask for (the API server refuses one above it), `maxRunning` how
many of them run at once (the operator's leader carries it into the ledger, and a deleted
TaskPolicy lifts it)."""

from __future__ import annotations

import time

import psycopg
import pytest

from e2e.system import (
    ANY_TASK_POLICY,
    apply_task_policy,
    discard_namespace,
    install_crd,
    prepare_namespace,
    task_manifest,
    wait_for,
)
from tests.cluster.test_operator import apply, phase_is, sh

CAPPED = "policy-max-priority"
EXEC = [{"name": "only", "exec": {"command": ["true"]}}]


def with_spec(**fields) -> dict:
    return {**ANY_TASK_POLICY, "spec": {**ANY_TASK_POLICY["spec"], **fields}}


@pytest.fixture
def capped(rig):
    install_crd(rig.kubectl)
    prepare_namespace(rig.kubectl, CAPPED, task_policy=with_spec(maxPriority=10))
    yield rig
    discard_namespace(rig.kubectl, CAPPED)


def dry_run(rig, name: str, priority: int):
    return rig.kubectl("create", "-n", CAPPED, "--dry-run=server", "-f", "-",
                       input=task_manifest(name, EXEC, priority=priority), check=False)


def test_a_task_above_its_namespaces_max_priority_is_refused_by_the_api_server_saying_so(capped):
    refused = dry_run(capped, "too-high", 11)
    assert refused.returncode != 0, "a Task of priority 11 was admitted under maxPriority 10"
    assert (f"spec.priority 11 is above 10, the highest the TaskPolicy of namespace {CAPPED} allows "
            "(its maxPriority)") in refused.stderr, refused.stderr
    assert dry_run(capped, "at-the-cap", 10).returncode == 0
    assert dry_run(capped, "below", -1000).returncode == 0


def namespace_run_limits(system) -> dict[str, int]:
    with psycopg.connect(system.dsn) as conn:
        return dict(conn.execute("SELECT namespace, max_running FROM retex.namespace_run_limits").fetchall())


def running(system) -> set[str]:
    """From the ledger, the truth: Task.status lags it by design."""
    return {task.name for task in system.ledger.running() if task.namespace == system.namespace}


def test_a_taskpolicy_max_running_lets_one_task_run_at_a_time_and_deleting_the_policy_lifts_it(retex):
    apply_task_policy(retex.rig.kubectl, retex.namespace, with_spec(maxRunning=1))
    wait_for(lambda: namespace_run_limits(retex).get(retex.namespace) == 1, timeout=30,
             what="the operator's leader carried maxRunning into the ledger")
    names = [f"one-at-a-time-{i}" for i in range(3)]
    for name in names:
        apply(retex, name, [sh("only", "sleep 6; echo done")])
    peak = 0
    deadline = time.monotonic() + 120
    while not phase_is(retex, names[0], "Succeeded") or not running(retex):  # the first done, the next started
        assert time.monotonic() < deadline, "the first task did not finish, or none started after it"
        peak = max(peak, len(running(retex)))
        time.sleep(0.2)
    assert peak == 1, "more than one task of the namespace ran at once under maxRunning 1"
    retex.kubectl("delete", "taskpolicy", "default")
    wait_for(lambda: len(running(retex)) == 2, timeout=30, what="the rest running at once, the limit lifted")
    assert retex.namespace not in namespace_run_limits(retex)
    wait_for(lambda: all(phase_is(retex, name, "Succeeded") for name in names), timeout=120, what="all Succeeded")
