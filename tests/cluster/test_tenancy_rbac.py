"""The operator writes only where a namespace was onboarded: its ClusterRole
reads and watches; Jobs, Leases and Events come from the RoleBinding manifests/tenant puts in each
tenant namespace. Proved with only the shipped RBAC: the operator holds a token of its
ServiceAccount and runs cluster-wide, as the Deployment does (like tests/cluster/test_rbac.py).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import psycopg
import pytest

from e2e.dev import service_account_kubeconfig
from e2e.rig.controlplane import run_kubectl
from e2e.system import (
    ANY_TASK_POLICY,
    OperatorProcess,
    apply_task_policy,
    discard_namespace,
    install_crd,
    prepare_namespace,
    task_manifest,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
LOCAL_OVERLAY = ROOT / "manifests" / "overlays" / "local"
OPERATOR = "system:serviceaccount:retex-system:retex-operator"
_numbers = itertools.count()


def can(rig, verb: str, resource: str, namespace: str) -> bool:
    answer = rig.kubectl("auth", "can-i", verb, resource, f"--as={OPERATOR}", "-n", namespace, check=False)
    assert answer.stdout.strip() in ("yes", "no"), answer.stderr
    return answer.stdout.strip() == "yes"


@pytest.fixture
def namespaces(rig, postgres):
    """One namespace onboarded (manifests/tenant), one with a TaskPolicy but not onboarded (so its
    Tasks are stored, and meet the operator: a namespace with neither is refused by the API server,
    tests/cluster/test_tenancy_policy.py); the operator's RBAC from the local overlay; a ledger
    database of this test."""
    number = next(_numbers)
    database, onboarded, bare = f"retex_onboard_{number}", f"onboarded-{number}", f"not-onboarded-{number}"
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    install_crd(rig.kubectl)
    rig.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(LOCAL_OVERLAY))
    prepare_namespace(rig.kubectl, onboarded)
    rig.create_namespace(bare)
    apply_task_policy(rig.kubectl, bare, ANY_TASK_POLICY)
    yield postgres.dsn(dbname=database), onboarded, bare
    for namespace in (onboarded, bare):
        discard_namespace(rig.kubectl, namespace)


@pytest.fixture
def operator_kubeconfig(rig, tmp_path):
    return service_account_kubeconfig(rig.kubectl, rig.kubeconfig, "retex-system", "retex-operator",
                                      tmp_path / "operator.kubeconfig")


def test_the_operator_cannot_create_jobs_pods_or_leases_in_kube_system_or_a_namespace_not_onboarded(
        rig, namespaces, operator_kubeconfig):
    _, onboarded, bare = namespaces
    for verb, resource in [("create", "jobs.batch"), ("delete", "jobs.batch"),
                           ("create", "leases.coordination.k8s.io"), ("create", "events")]:
        assert can(rig, verb, resource, onboarded), (verb, resource)
        for namespace in ("kube-system", bare, "default"):
            assert not can(rig, verb, resource, namespace), (verb, resource, namespace)
    for namespace in ("kube-system", bare, onboarded):
        assert not can(rig, "create", "pods", namespace), namespace
    # Still cluster-wide: what it reads and watches, and the Tasks' status (a Task anywhere can be
    # told why it does not run).
    for verb, resource in [("watch", "tasks.retex.dev"), ("list", "leases.coordination.k8s.io"),
                           ("get", "jobs.batch"), ("patch", "tasks.retex.dev/status")]:
        assert can(rig, verb, resource, bare), (verb, resource)

    # A real call as the operator: a Job in kube-system (dry run) is refused by RBAC.
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "escape", "namespace": "kube-system"},
           "spec": {"template": {"spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "c", "image": "x", "command": ["true"]}]}}}}
    refused = run_kubectl(operator_kubeconfig, "create", "--dry-run=server", "-f", "-", input=json.dumps(job),
                          check=False)
    assert refused.returncode != 0 and 'cannot create resource "jobs"' in refused.stderr, refused.stderr


def test_a_task_in_a_namespace_not_onboarded_is_refused_naming_the_missing_rolebinding_and_others_still_run(
        rig, namespaces, operator_kubeconfig, tmp_path):
    dsn, onboarded, bare = namespaces
    operator = OperatorProcess.on(rig, dsn, tmp_path / "operator.log", kubeconfig=operator_kubeconfig)  # cluster-wide, as deployed
    operator.start()
    try:
        steps = [{"name": "only", "exec": {"command": ["sh", "-c", "echo ran"]}}]
        # The stray Task first: it must not hold up the onboarded namespace's.
        rig.kubectl("apply", "-n", bare, "-f", "-", input=task_manifest("stray", steps))
        rig.kubectl("apply", "-n", onboarded, "-f", "-", input=task_manifest("welcome", steps))

        def status_of(namespace: str, name: str) -> dict:
            task = json.loads(rig.kubectl("get", "-n", namespace, "task", name, "-o", "json").stdout)
            return task.get("status") or {}

        refused = wait_for(lambda: status_of(bare, "stray").get("phase") == "Refused" and status_of(bare, "stray"),
                           timeout=60, what="the stray Task refused")
        accepted = next(c for c in refused["conditions"] if c["type"] == "Accepted")
        assert (accepted["status"], accepted["reason"]) == ("False", "NamespaceNotOnboarded"), accepted
        assert f"namespace {bare} is not onboarded" in accepted["message"]
        assert f"no RoleBinding retex-operator to the ClusterRole retex-operator-tenant in {bare}" in accepted["message"]
        assert f"kubectl apply -n {bare} -k manifests/tenant" in accepted["message"]

        waited = rig.kubectl("wait", "-n", onboarded, "--for=condition=Succeeded", "--timeout=90s", "task/welcome",
                             check=False)
        assert waited.returncode == 0, f"{waited.stderr}\n--- operator log ---\n{operator.log_tail()}"
        assert json.loads(rig.kubectl("get", "-n", bare, "jobs,leases", "-o", "json").stdout)["items"] == []
        assert operator.exited() is None, operator.log_tail()
    finally:
        operator.stop()
