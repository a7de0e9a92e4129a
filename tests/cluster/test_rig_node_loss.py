"""Node loss on the rig: killing an agent with its pods makes the node NotReady, the taint
manager evicts its pods and a Job's replacement runs on the surviving node, within seconds."""

from __future__ import annotations

import os
import time

import pytest
from kubernetes import client

from e2e.rig.controlplane import wait_for
from e2e.rig.waits import container_pid, job_pods, pod_or_none, process_gone, wait_pod_gone

pytestmark = pytest.mark.skipif(bool(os.environ.get("RETEX_KUBECONFIG")),
                                reason="proves the local rig itself")
NAMESPACE = "rig-node-loss"
# node-monitor-grace-period (10 s) + default unreachable toleration (5 s) + scheduling and
# start-up, with room for a loaded 2-core machine.
REPLACEMENT_BOUND = 40


def ready(core: client.CoreV1Api, node: str) -> str:
    conditions = core.read_node(node).status.conditions or []
    return next(c.status for c in conditions if c.type == "Ready")


def test_killed_node_goes_not_ready_and_its_job_pod_is_replaced_on_the_other_node(rig, apis):
    core, batch = apis
    batch.create_namespaced_job(NAMESPACE, {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "survivor"},
        "spec": {"backoffLimit": 5, "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "retex",
                            "command": ["sh", "-c", "while :; do sleep 0.2; done"]}]}}}})

    def running_pods():
        pods = [p for p in job_pods(core, NAMESPACE, "survivor")
                if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]
        return pods
    [first] = wait_for("the Job's pod running", running_pods, 30)
    victim = first.spec.node_name
    [survivor_node] = [n for n in rig.nodes if n != victim]
    pid = container_pid(first)

    started = time.monotonic()
    rig.kill_node(victim)
    wait_for("the pod's process to die with its node", lambda: process_gone(pid), 5)
    try:
        wait_for(f"{victim} NotReady", lambda: ready(core, victim) != "True", 25)
        not_ready_after = time.monotonic() - started

        def evicted():
            pod = pod_or_none(core, NAMESPACE, first.metadata.name)
            conditions = {c.type: c for c in pod.status.conditions or []}
            target = conditions.get("DisruptionTarget")
            return (pod.metadata.deletion_timestamp is not None and target is not None
                    and target.reason == "DeletionByTaintManager")
        wait_for(f"{first.metadata.name} evicted by the taint manager", evicted, 20)

        [replacement] = wait_for("a replacement pod running", running_pods, REPLACEMENT_BOUND)
        replaced_after = time.monotonic() - started
        assert replacement.metadata.uid != first.metadata.uid
        assert replacement.spec.node_name == survivor_node
        assert replaced_after < REPLACEMENT_BOUND
        print(f"NotReady after {not_ready_after:.1f}s, replacement running after "
              f"{replaced_after:.1f}s")
    finally:
        rig.restart_node(victim)

    # The node is back (restart_node waited for Ready without taints); as a kubelet after a
    # reboot, its agent finishes the evicted pod: it is deleted.
    assert ready(core, victim) == "True"
    wait_pod_gone(core, NAMESPACE, first.metadata.name, uid=first.metadata.uid, timeout=20)
