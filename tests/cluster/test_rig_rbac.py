"""Pods on the rig act as their service account (RBAC is real) and as their securityContext user."""

from __future__ import annotations

import os

import pytest
from kubernetes import client

from e2e.rig.controlplane import wait_for
from e2e.rig.waits import pod_or_none, wait_pod_phase

pytestmark = pytest.mark.skipif(bool(os.environ.get("RETEX_KUBECONFIG")),
                                reason="proves the local rig itself")
NAMESPACE = "rig-rbac"

# Runs inside the pod with the project's interpreter and its kubeconfig (KUBECONFIG).
PROBE = """
import os
from kubernetes import client, config
config.load_kube_config()
core = client.CoreV1Api()
print("uid", os.getuid())
print("configmaps", sorted(c.metadata.name for c in core.list_namespaced_config_map(os.environ["NS"]).items))
try:
    core.list_namespaced_secret(os.environ["NS"])
    print("secrets allowed")
except client.ApiException as e:
    print("secrets", e.status)
"""


@pytest.fixture(scope="module")
def core(rig):
    rig.create_namespace(NAMESPACE)
    with rig.api_client() as api:
        yield client.CoreV1Api(api)
    rig.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def probe_pod(name: str, security_context: dict, service_account: str = "default") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "serviceAccountName": service_account,
        "securityContext": security_context,
        "containers": [{"name": "main", "image": "retex", "command": ["python", "-c", PROBE],
                        "env": [{"name": "NS", "valueFrom": {"fieldRef": {
                            "fieldPath": "metadata.namespace"}}}]}]}}


def test_pod_is_refused_what_rbac_forbids_and_allowed_what_its_role_grants(rig, core):
    rig.kubectl("-n", NAMESPACE, "create", "serviceaccount", "reader")
    rig.kubectl("-n", NAMESPACE, "create", "role", "read-configmaps", "--verb=get,list",
                "--resource=configmaps")
    rig.kubectl("-n", NAMESPACE, "create", "rolebinding", "reader", "--role=read-configmaps",
                f"--serviceaccount={NAMESPACE}:reader")
    rig.kubectl("-n", NAMESPACE, "create", "configmap", "visible", "--from-literal=a=b")
    rig.kubectl("-n", NAMESPACE, "create", "secret", "generic", "hidden", "--from-literal=a=b")
    core.create_namespaced_pod(NAMESPACE, probe_pod("reader", {"runAsUser": 1000},
                                                    service_account="reader"))

    wait_pod_phase(core, NAMESPACE, "reader", "Succeeded", "Failed")
    output = rig.pod_log(NAMESPACE, "reader").splitlines()
    assert output == ["uid 1000", "configmaps ['visible']", "secrets 403"]


def test_run_as_non_root_without_a_uid_runs_as_nobody(rig, core):
    core.create_namespaced_pod(NAMESPACE, probe_pod("nobody", {"runAsNonRoot": True}))

    wait_pod_phase(core, NAMESPACE, "nobody", "Succeeded", "Failed")
    # The default service account may not even list configmaps: the probe fails after this line.
    assert "uid 65534" in rig.pod_log(NAMESPACE, "nobody").splitlines()


def test_run_as_non_root_with_uid_0_is_refused_like_the_kubelet_does(core):
    core.create_namespaced_pod(NAMESPACE, probe_pod("rooted", {"runAsNonRoot": True,
                                                               "runAsUser": 0}))

    def refused():
        pod = pod_or_none(core, NAMESPACE, "rooted")
        statuses = (pod.status.container_statuses or []) if pod else []
        waiting = statuses[0].state.waiting if statuses else None
        return waiting is not None and waiting.reason == "CreateContainerConfigError"
    wait_for("pod rooted refused", refused, 20)
    assert core.read_namespaced_pod("rooted", NAMESPACE).status.phase == "Pending"
