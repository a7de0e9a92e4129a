"""`confine_nodes` (what the benchmark's scale measure runs its workers under, off the operator's
core) really confines: a pod started while the nodes are confined sees only those CPUs, one
started after `release_nodes` sees every CPU again. On the rig (node agents' CPU masks) and on
kind (the node containers' cpuset cgroups)."""

from __future__ import annotations

import os

import pytest

from e2e.rig.waits import wait_job_finished

NAMESPACE = "confined-nodes"


def job(name: str, image: str) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [
                {"name": "main", "image": image, "command": ["grep", "Cpus_allowed_list", "/proc/self/status"]}]}}}}


def cpus_allowed(line: str) -> set[int]:
    """The CPUs of a `Cpus_allowed_list:\t0,2-3` line."""
    cpus: set[int] = set()
    for part in line.split(":")[1].strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def cpus_of(rig, batch, name: str) -> set[int]:
    batch.create_namespaced_job(NAMESPACE, job(name, rig.worker_image))
    assert wait_job_finished(batch, NAMESPACE, name, timeout=90) == "Complete"
    [end] = rig.pod_ends(NAMESPACE, name)
    return cpus_allowed(end.log)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="confining to one core needs two")
def test_confined_nodes_start_pods_on_those_cpus_only_until_released(rig, apis):
    _, batch = apis
    every = os.sched_getaffinity(0)
    last = max(every)
    try:
        rig.confine_nodes({last})
        confined = cpus_of(rig, batch, "confined")
    finally:
        rig.release_nodes()
    assert confined == {last}
    assert cpus_of(rig, batch, "released") == every
