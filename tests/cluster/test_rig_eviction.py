"""Pods on the rig leave as on a kubelet: SIGTERM, the grace period, SIGKILL, then deletion."""

from __future__ import annotations

import os
import threading
import time

import pytest
from kubernetes import client, watch

from e2e.rig.controlplane import wait_for
from e2e.rig.waits import container_pid, process_gone, wait_pod_gone, wait_pod_phase

pytestmark = pytest.mark.skipif(bool(os.environ.get("RETEX_KUBECONFIG")),
                                reason="proves the local rig itself")
NAMESPACE = "rig-eviction"


@pytest.fixture(scope="module")
def core(rig):
    rig.create_namespace(NAMESPACE)
    with rig.api_client() as api:
        yield client.CoreV1Api(api)
    rig.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def pod(name: str, script: str, grace: int, env: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": grace,
        "containers": [{"name": "main", "image": "retex", "command": ["sh", "-c", script],
                        "env": [{"name": k, "value": v} for k, v in env.items()]}]}}


def test_evicted_pod_gets_sigterm_exits_and_is_deleted_with_a_disruption_condition(core, tmp_path):
    marker = tmp_path / "marker"
    script = ('trap \'echo got-SIGTERM >> "$MARKER"; exit 0\' TERM; echo started > "$MARKER"; '
              "while :; do sleep 0.1; done")
    core.create_namespaced_pod(NAMESPACE, pod("evictee", script, grace=30,
                                              env={"MARKER": str(marker)}))
    running = wait_pod_phase(core, NAMESPACE, "evictee", "Running")
    wait_for("the pod's command to start", lambda: marker.exists(), 10)

    # Watch the pod from here on: its last states are gone too fast to poll.
    seen: list[client.V1Pod] = []
    stream = watch.Watch()

    def observe():
        for event in stream.stream(core.list_namespaced_pod, NAMESPACE,
                                   field_selector="metadata.name=evictee",
                                   resource_version=running.metadata.resource_version,
                                   timeout_seconds=30):
            seen.append(event["object"])
            if event["type"] == "DELETED":
                return
    observer = threading.Thread(target=observe)
    observer.start()

    started = time.monotonic()
    core.create_namespaced_pod_eviction("evictee", NAMESPACE, client.V1Eviction(
        metadata=client.V1ObjectMeta(name="evictee", namespace=NAMESPACE)))
    wait_pod_gone(core, NAMESPACE, "evictee", timeout=20)
    elapsed = time.monotonic() - started
    observer.join(10)

    assert marker.read_text().split() == ["started", "got-SIGTERM"]
    assert elapsed < 10, "the process should exit on SIGTERM, long before the 30 s grace period"
    assert process_gone(container_pid(running))
    disruption = [c for p in seen for c in p.status.conditions or [] if c.type == "DisruptionTarget"]
    assert disruption and disruption[0].reason == "EvictionByEvictionAPI"
    final = [p for p in seen if p.metadata.deletion_timestamp is not None][-1]
    assert final.status.container_statuses[0].state.terminated.exit_code == 0


def test_process_ignoring_sigterm_is_killed_when_the_grace_period_ends(core):
    core.create_namespaced_pod(NAMESPACE, pod("stubborn", "trap '' TERM; while :; do sleep 0.1; done",
                                              grace=2, env={}))
    running = wait_pod_phase(core, NAMESPACE, "stubborn", "Running")
    pid = container_pid(running)

    started = time.monotonic()
    core.delete_namespaced_pod("stubborn", NAMESPACE)
    wait_pod_gone(core, NAMESPACE, "stubborn", timeout=20)
    elapsed = time.monotonic() - started

    assert 2 <= elapsed < 8, f"deleted after {elapsed:.1f}s; grace period is 2s"
    assert process_gone(pid)
