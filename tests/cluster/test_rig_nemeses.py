"""The rig's other nemeses: a paused pod process, restarted etcd, API server and controller
manager — and the cluster (agents, watches, status reports) carries on afterwards."""

from __future__ import annotations

import os

import pytest

from e2e.rig.controlplane import wait_for
from e2e.rig.waits import container_pid, wait_job_finished, wait_pod_phase

pytestmark = pytest.mark.skipif(bool(os.environ.get("RETEX_KUBECONFIG")),
                                reason="proves the local rig itself")
NAMESPACE = "rig-nemeses"


def waiting_pod(name: str, go_file: str) -> dict:
    """A pod that runs until `go_file` exists, then exits 0."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "retex", "command": [
            "sh", "-c", f'while [ ! -e "{go_file}" ]; do sleep 0.1; done']}]}}


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_paused_pod_is_stopped_until_resumed(rig, apis, tmp_path):
    core, _ = apis
    go = tmp_path / "go"
    core.create_namespaced_pod(NAMESPACE, waiting_pod("sleeper", str(go)))
    pid = container_pid(wait_pod_phase(core, NAMESPACE, "sleeper", "Running"))

    rig.pause_pod(NAMESPACE, "sleeper")
    wait_for("the pod's process stopped", lambda: process_state(pid) == "T", 5)  # async delivery
    go.touch()
    assert core.read_namespaced_pod("sleeper", NAMESPACE).status.phase == "Running"

    rig.resume_pod(NAMESPACE, "sleeper")
    wait_pod_phase(core, NAMESPACE, "sleeper", "Succeeded", timeout=10)


def test_cluster_carries_on_through_etcd_apiserver_and_controller_manager_restarts(rig, apis,
                                                                                  tmp_path):
    core, batch = apis
    go = tmp_path / "go"
    core.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": "before"}})
    core.create_namespaced_pod(NAMESPACE, waiting_pod("through", str(go)))
    wait_pod_phase(core, NAMESPACE, "through", "Running")

    rig.restart_etcd(hard=True)
    rig.restart_apiserver(hard=True)
    rig.restart_controller_manager()

    # Data survived, the agent's watch and status reports came back, the controllers work.
    assert core.read_namespaced_config_map("before", NAMESPACE).metadata.name == "before"
    go.touch()
    wait_pod_phase(core, NAMESPACE, "through", "Succeeded", timeout=30)
    batch.create_namespaced_job(NAMESPACE, {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "after"},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "retex", "command": ["true"]}]}}}})
    assert wait_job_finished(batch, NAMESPACE, "after", timeout=60) == "Complete"
    rig.wait_nodes_ready(rig.nodes, timeout=10)
