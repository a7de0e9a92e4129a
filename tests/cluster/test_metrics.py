"""The operator's metrics endpoint, scraped during a run: counters and gauges match what happened."""

from __future__ import annotations

from e2e.system import wait_for
from tests.cluster.test_operator import apply, phase_is, sh


def test_metrics_count_tasks_attempts_and_durations_as_they_happened(retex):
    wait_for(lambda: _reachable(retex), timeout=30, what="metrics endpoint")
    apply(retex, "ok-1", [sh("a", "echo a"), sh("b", "echo b")])
    apply(retex, "ok-2", [sh("a", "echo a")])
    apply(retex, "bad", [{"name": "a", "exec": {"command": ["sh", "-c", "exit 3"]}, "permanentExitCodes": [3]}])
    for name, phase in (("ok-1", "Succeeded"), ("ok-2", "Succeeded"), ("bad", "Failed")):
        wait_for(lambda n=name, p=phase: phase_is(retex, n, p), timeout=90, what=f"{name} {phase}")

    def settled():
        metrics = retex.operator.metrics()
        return metrics if metrics[("retex_tasks", (("phase", "Succeeded"),))] == 2 else None

    metrics = wait_for(settled, timeout=20, what="metrics to catch up")
    assert metrics[("retex_tasks", (("phase", "Failed"),))] == 1
    assert metrics[("retex_tasks", (("phase", "Queued"),))] == 0
    assert metrics[("retex_tasks_submitted_total", ())] == 3
    assert metrics[("retex_tasks_finished_total", (("outcome", "succeeded"),))] == 2
    assert metrics[("retex_tasks_finished_total", (("outcome", "failed"),))] == 1
    assert metrics[("retex_attempts_started_total", (("cause", "first"),))] == 3
    assert metrics[("retex_attempts_started_total", (("cause", "retry"),))] == 0
    assert metrics[("retex_step_duration_seconds_count", ())] == 4  # three done, one failed
    assert metrics[("retex_task_duration_seconds_count", ())] == 3
    assert metrics[("retex_task_first_step_seconds_count", ())] == 3
    assert metrics[("retex_status_mirror_lag_seconds_count", ())] > 0
    assert metrics[("retex_outbox_lag_seconds", ())] == 0
    labels = {dict(key[1]).keys().__iter__().__next__() for key in metrics if key[1]}
    assert not labels & {"uid", "task", "name", "namespace"}, "no unbounded labels"


def _reachable(system) -> bool:
    try:
        system.operator.metrics()
        return True
    except OSError:
        return False
