"""The operator's cluster-wide watches select worker pods and worker Leases by the label
`retex.dev/task-uid`. A tenant cannot put it on objects of its own (manifests/base/
worker-label-policy.yaml): not on a pod, not on a Job's pod template (the Job controller would
copy it onto each pod), not on a Lease, neither at creation nor by an update; its other objects are
admitted as before. And the watches list page by page, then watch from the list's version.

A Task's worker pod, made by the Job controller from the operator's Job, still runs under the
policy: tests/cluster/test_operator.py::test_a_multi_step_task_goes_from_pending_to_succeeded_showing_each_committed_step.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from kubernetes import client

from e2e.system import discard_namespace, install_crd, wait_for
from retex.kube import watching
from retex.kube.leasewatch import LeaseObserver
from retex.kube.objects import LABEL_TASK_UID, build_lease

TENANT_NAMESPACE = "label-tenant"
TENANT = "mallory"  # a user who may create and update pods, Jobs and Leases in its namespace
UNSCHEDULABLE = {"nodeSelector": {"retex.dev/test-node": "nowhere"}}  # admitted, never run


@pytest.fixture(scope="module")
def tenant(rig):
    install_crd(rig.kubectl)  # manifests/base's admission policies
    rig.kubectl("create", "namespace", TENANT_NAMESPACE)
    rights = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "tenant"},
         "rules": [{"apiGroups": ["", "batch", "coordination.k8s.io"], "resources": ["pods", "pods/status", "jobs", "leases"],
                    "verbs": ["create", "get", "update", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "tenant"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT}]},
    ]
    for obj in rights:
        rig.kubectl("apply", "-n", TENANT_NAMESPACE, "-f", "-", input=json.dumps(obj))
    yield rig
    discard_namespace(rig.kubectl, TENANT_NAMESPACE)


def as_tenant(rig, verb: str, obj: dict, *args: str):
    return rig.kubectl(verb, "-n", TENANT_NAMESPACE, f"--as={TENANT}", "-f", "-", *args,
                       input=json.dumps(obj), check=False)


def pod(name: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "busybox"}], **UNSCHEDULABLE}}


def lease(name: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name, "labels": labels},
            "spec": {"leaseDurationSeconds": 15}}


def refused(rig, obj: dict) -> str:
    """The API server's refusal of the tenant's `obj` (a dry run), waited for while the policies
    may not be in force yet (the API server picks new ones up within seconds); '' if admitted."""
    deadline = time.monotonic() + 20
    while True:
        done = as_tenant(rig, "create", obj, "--dry-run=server")
        if done.returncode != 0 or time.monotonic() > deadline:
            return done.stderr.strip()
        time.sleep(0.5)


def test_a_tenants_pod_carrying_the_task_uid_label_is_refused_and_its_other_pods_are_admitted(tenant):
    forged = pod("forged", {LABEL_TASK_UID: str(uuid.uuid4())})
    refusal = refused(tenant, forged)
    assert "only the Job controller creates one" in refusal and TENANT in refusal, refusal
    assert as_tenant(tenant, "create", forged).returncode != 0
    ordinary = as_tenant(tenant, "create", pod("ordinary", {"app": "shop"}))
    assert ordinary.returncode == 0, ordinary.stderr
    relabelled = tenant.kubectl("label", "pod", "ordinary", "-n", TENANT_NAMESPACE, f"--as={TENANT}",
                                f"{LABEL_TASK_UID}={uuid.uuid4()}", check=False)
    assert relabelled.returncode != 0 and "no update adds it" in relabelled.stderr, relabelled.stderr


def test_a_tenant_cannot_put_the_task_uid_label_on_a_pod_through_its_status(tenant):
    as_tenant(tenant, "create", pod("by-status", {"app": "shop"}))
    patched = tenant.kubectl("patch", "pod", "by-status", "-n", TENANT_NAMESPACE, f"--as={TENANT}",
                             "--subresource=status", "--type=merge",
                             "-p", json.dumps({"metadata": {"labels": {LABEL_TASK_UID: str(uuid.uuid4())}}}), check=False)
    labels = json.loads(tenant.kubectl("get", "pod", "by-status", "-n", TENANT_NAMESPACE, "-o", "json").stdout
                        )["metadata"].get("labels") or {}
    assert LABEL_TASK_UID not in labels, f"labelled through pods/status: {patched.stdout} {patched.stderr}"


def test_a_tenants_job_whose_pods_would_carry_the_task_uid_label_is_refused(tenant):
    labelled = pod("x", {LABEL_TASK_UID: str(uuid.uuid4())})
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "forged"},
           "spec": {"template": {"metadata": {"labels": labelled["metadata"]["labels"]},
                                 "spec": {**labelled["spec"], "restartPolicy": "Never"}}}}
    refusal = refused(tenant, job)
    assert "only the retex operator creates a Job" in refusal, refusal
    job["spec"]["template"]["metadata"]["labels"] = {"app": "shop"}
    ordinary = as_tenant(tenant, "create", job, "--dry-run=server")
    assert ordinary.returncode == 0, ordinary.stderr


def test_a_tenants_lease_carrying_the_task_uid_label_is_refused_and_its_other_leases_are_admitted(tenant):
    refusal = refused(tenant, lease("forged", {LABEL_TASK_UID: str(uuid.uuid4())}))
    assert "only the retex operator creates one" in refusal and TENANT in refusal, refusal
    ordinary = as_tenant(tenant, "create", lease("its-own-election", {}))
    assert ordinary.returncode == 0, ordinary.stderr
    relabelled = tenant.kubectl("label", "lease", "its-own-election", "-n", TENANT_NAMESPACE, f"--as={TENANT}",
                                f"{LABEL_TASK_UID}={uuid.uuid4()}", check=False)
    assert relabelled.returncode != 0 and "no update adds it" in relabelled.stderr, relabelled.stderr


def test_the_lease_watch_lists_page_by_page_and_watches_on_from_the_list(rig, kube, monkeypatch):
    """More worker Leases than a page: each is seen once, the LIST went in pages (`limit`,
    `continue`), and a Lease created after it arrives through the watch."""
    namespace = "paged-leases"
    rig.kubectl("create", "namespace", namespace)
    coordination = client.CoordinationV1Api(kube)
    uids = {f"paged-{n}": str(uuid.uuid4()) for n in range(6)}

    def create(name: str) -> None:  # as the operator creates them (the rig's operator is the admin)
        body = build_lease(task_name=name, task_uid=uids[name], namespace=namespace, duration_seconds=15)
        body["metadata"].pop("ownerReferences", None)  # no Task: the garbage collector would delete it
        body["metadata"]["name"] = name
        coordination.create_namespaced_lease(namespace, body)

    for name in list(uids)[:5]:
        create(name)
    lists: list[dict] = []
    real = client.CoordinationV1Api.list_lease_for_all_namespaces

    def recorded(self, **kwargs):
        if not kwargs.get("watch"):
            lists.append({k: kwargs.get(k) for k in ("limit", "_continue")})
        return real(self, **kwargs)

    monkeypatch.setattr(client.CoordinationV1Api, "list_lease_for_all_namespaces", recorded)
    monkeypatch.setattr(watching, "LIST_PAGE_SIZE", 2)
    observer = LeaseObserver(kube)
    running = threading.Thread(target=observer.run, daemon=True)
    running.start()
    try:
        assert observer.synced.wait(30), "the first list ended"
        assert all(observer.get(namespace, name, uid) for name, uid in list(uids.items())[:5])
        assert len(lists) >= 3 and all(page["limit"] == 2 for page in lists), lists
        assert lists[0]["_continue"] is None and all(page["_continue"] for page in lists[1:]), lists
        listed = len(lists)
        create("paged-5")
        wait_for(lambda: observer.get(namespace, "paged-5", uids["paged-5"]), timeout=20, what="the watched Lease")
        assert len(lists) == listed, "seen through the watch, not a relist"
    finally:
        observer.stop()
        rig.kubectl("delete", "namespace", namespace, "--wait=false", check=False)  # its DELETEDs end the watch
        running.join(30)
