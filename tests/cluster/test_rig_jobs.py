"""The local rig runs a Job's pod as a real process on a node agent, and the Job follows it."""

from __future__ import annotations

import os

import pytest

from e2e.rig.waits import job_pods, wait_job_finished, wait_pod_phase

pytestmark = pytest.mark.skipif(bool(os.environ.get("RETEX_KUBECONFIG")),
                                reason="proves the local rig itself")
NAMESPACE = "rig-jobs"


def job(name: str, container: dict) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "main", "image": "retex",
                                                          **container}]}}}}


def test_job_pod_runs_the_real_command_with_resolved_env_and_the_job_completes(rig, apis, tmp_path):
    core, batch = apis
    out = tmp_path / "out.txt"
    core.create_namespaced_secret(NAMESPACE, {"metadata": {"name": "creds"},
                                              "stringData": {"token": "s3cret"}})
    core.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": "settings"},
                                                  "data": {"greeting": "hello", "mode": "fast"}})
    field = lambda path: {"fieldRef": {"fieldPath": path}}  # noqa: E731
    batch.create_namespaced_job(NAMESPACE, job("echo", {
        # $(GREETING) is expanded by Kubernetes (not the shell) from the container's env.
        "command": ["sh", "-c", 'echo "$(GREETING) $POD $NODE $NS $SA $TOKEN $CFG_mode $IP" > "$OUT"'
                                '; test -r "$KUBECONFIG"; echo wrote'],
        "env": [
            {"name": "OUT", "value": str(out)},
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
            {"name": "POD", "valueFrom": field("metadata.name")},
            {"name": "NODE", "valueFrom": field("spec.nodeName")},
            {"name": "NS", "valueFrom": field("metadata.namespace")},
            {"name": "SA", "valueFrom": field("spec.serviceAccountName")},
            {"name": "IP", "valueFrom": field("status.podIP")},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        ],
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
    }))

    assert wait_job_finished(batch, NAMESPACE, "echo", timeout=60) == "Complete"
    [pod] = job_pods(core, NAMESPACE, "echo")
    assert pod.spec.node_name in rig.nodes
    assert pod.status.phase == "Succeeded"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0
    assert out.read_text().split() == [
        "hello", pod.metadata.name, pod.spec.node_name, NAMESPACE, "default", "s3cret", "fast",
        "127.0.0.1"]
    assert rig.pod_log(NAMESPACE, pod.metadata.name) == "wrote\n"


def test_failing_command_fails_the_pod_with_its_exit_code_and_the_job(rig, apis):
    core, batch = apis
    batch.create_namespaced_job(NAMESPACE, job("fail", {"command": ["sh", "-c", "exit 3"]}))

    assert wait_job_finished(batch, NAMESPACE, "fail", timeout=60) == "Failed"
    [pod] = job_pods(core, NAMESPACE, "fail")
    assert pod.status.phase == "Failed"
    terminated = pod.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (3, "Error")


def test_kubectl_works_against_the_rig_kubeconfig(rig):
    nodes = rig.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert sorted(nodes) == sorted(f"node/{name}" for name in rig.nodes)
    ready = rig.kubectl("get", "nodes", "-o",
                        'jsonpath={.items[*].status.conditions[?(@.type=="Ready")].status}').stdout
    assert ready.split() == ["True"] * len(rig.nodes)


def test_on_failure_pod_is_restarted_in_place_and_then_succeeds(rig, apis):
    core, _ = apis
    # The working directory survives restarts (it is the pod's), so the second run succeeds.
    core.create_namespaced_pod(NAMESPACE, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "second-time-lucky"},
        "spec": {"restartPolicy": "OnFailure", "containers": [{
            "name": "main", "image": "retex",
            "command": ["sh", "-c", "[ -e tried ] || { touch tried; exit 1; }"]}]}})

    pod = wait_pod_phase(core, NAMESPACE, "second-time-lucky", "Succeeded", "Failed")
    assert pod.status.phase == "Succeeded"
    status = pod.status.container_statuses[0]
    assert status.restart_count == 1
    assert status.last_state.terminated.exit_code == 1
