"""The shipped RBAC is enough and no more: the operator runs a real Task to Succeeded holding only
a token of its ServiceAccount (bound to manifests/base's ClusterRole), the worker pod only
`retex-worker`'s Role; and neither identity can do what it has no business doing.

The operator here runs cluster-wide, as the Deployment does. The rig authorizes with RBAC for real
(docs/contributing/testing.md); `kubectl auth can-i --as` asks the same authorizer, and each "no" is also
shown with a real call that the API server refuses.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import psycopg
import pytest

from e2e.dev import service_account_kubeconfig
from e2e.rig.controlplane import run_kubectl
from e2e.system import OperatorProcess, discard_namespace, install_crd, prepare_namespace, task_manifest, wait_for

ROOT = Path(__file__).resolve().parents[2]
LOCAL_OVERLAY = ROOT / "manifests" / "overlays" / "local"
OPERATOR = "system:serviceaccount:retex-system:retex-operator"
_numbers = itertools.count()


def worker(namespace: str) -> str:
    return f"system:serviceaccount:{namespace}:retex-worker"


def can(rig, user: str, verb: str, resource: str, namespace: str | None = None, subresource: str | None = None) -> bool:
    args = ["auth", "can-i", verb, resource, f"--as={user}"]
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    args += [f"--subresource={subresource}"] if subresource else []
    answer = rig.kubectl(*args, check=False)
    assert answer.stdout.strip() in ("yes", "no"), answer.stderr
    return answer.stdout.strip() == "yes"


def refused(kubeconfig: Path, *args: str, input: str | None = None) -> str:
    result = run_kubectl(kubeconfig, *args, input=input, check=False)
    assert result.returncode != 0 and "Forbidden" in result.stderr, (result.stdout, result.stderr)
    return result.stderr


@pytest.fixture
def tenants(rig, postgres, tmp_path):
    """Two tenant namespaces prepared as users do (worker RBAC + DSN Secret), the operator's RBAC
    from the local overlay, and a ledger database for this test."""
    number = next(_numbers)
    database, mine, other = f"retex_rbac_{number}", f"rbac-tenant-{number}", f"rbac-other-{number}"
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    dsn = postgres.dsn(dbname=database)
    install_crd(rig.kubectl)
    rig.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(LOCAL_OVERLAY))
    for namespace in (mine, other):
        prepare_namespace(rig.kubectl, namespace)
    yield dsn, mine, other
    for namespace in (mine, other):
        discard_namespace(rig.kubectl, namespace)


def test_operator_and_worker_run_a_task_to_succeeded_with_only_the_shipped_rbac(rig, tenants, tmp_path):
    dsn, namespace, _ = tenants
    kubeconfig = service_account_kubeconfig(rig.kubectl, rig.kubeconfig, "retex-system", "retex-operator",
                                            tmp_path / "operator.kubeconfig")
    operator = OperatorProcess.on(rig, dsn, tmp_path / "operator.log", kubeconfig=kubeconfig)  # cluster-wide, as deployed
    operator.start()
    try:
        steps = [{"name": "first", "exec": {"command": ["sh", "-c", "echo one"]}},
                 {"name": "second", "idempotent": True, "exec": {"command": ["sh", "-c", "echo two"]}}]
        rig.kubectl("apply", "-n", namespace, "-f", "-", input=task_manifest("rbac-proof", steps))
        waited = rig.kubectl("wait", "-n", namespace, "--for=condition=Succeeded", "--timeout=90s",
                             "task/rbac-proof", check=False)
        assert waited.returncode == 0, f"{waited.stderr}\n--- operator log ---\n{operator.log_tail()}"

        task = json.loads(rig.kubectl("get", "-n", namespace, "task", "rbac-proof", "-o", "json").stdout)
        assert task["status"]["progress"] == "2/2"  # tasks/status patch
        assert "kopf.retex.dev/last-handled-configuration" in task["metadata"]["annotations"]  # kopf's patch
        assert "retex.dev/finalizer" in task["metadata"]["finalizers"]
        job = json.loads(rig.kubectl("get", "-n", namespace, "jobs", "-o", "json").stdout)["items"][0]
        assert job["spec"]["template"]["spec"]["serviceAccountName"] == "retex-worker"  # jobs create
        lease = json.loads(rig.kubectl("get", "-n", namespace, "leases", "-l", "retex.dev/task-uid",
                                       "-o", "json").stdout)["items"][0]  # leases create, the worker's update
        assert lease["metadata"]["annotations"]["retex.dev/released-by"].startswith(f"{job['metadata']['name']}-")

        def reasons() -> set[str]:  # posted by the operator's Event poster, after the status write
            events = json.loads(rig.kubectl("get", "-n", namespace, "events", "-o", "json").stdout)["items"]
            return {e["reason"] for e in events if e["involvedObject"]["name"] == "rbac-proof"}

        wait_for(lambda: "Succeeded" in reasons(), timeout=20, what="the Succeeded Event")
        # Deletion: kopf's delete handler runs and takes its finalizer off (tasks patch).
        rig.kubectl("delete", "-n", namespace, "task", "rbac-proof", "--timeout=30s")
    finally:
        operator.stop()
    # RBAC refusals as the API server words them, kopf's fallbacks, the lease watcher's 403, in lines
    # about this test's namespace or about none. The operator watches every namespace: another
    # test's leftover Tasks, in namespaces being deleted, were never granted to it and are refused
    # for that (seen in CI: "not onboarded", the dry-run's 403 in its traceback).
    for line in operator.log_path.read_text().splitlines():
        if _namespace_of(line) not in (namespace, None):
            continue
        assert not (OPERATOR in line and " cannot " in line), line
        assert "Not enough permissions" not in line, line
        assert not ("lease watch failed" in line and '"http_status": 403' in line), line


def _namespace_of(log_line: str) -> str | None:
    try:
        return json.loads(log_line).get("namespace")
    except ValueError:  # not one of the operator's JSON lines (e.g. a warning printed by a library)
        return None


def test_a_worker_cannot_patch_task_status_read_secrets_or_touch_another_namespaces_leases(rig, tenants, tmp_path):
    _, namespace, other = tenants
    user = worker(namespace)
    # What it needs, in its own namespace only:
    assert can(rig, user, "get", "leases.coordination.k8s.io", namespace)
    assert can(rig, user, "update", "leases.coordination.k8s.io", namespace)
    # And nothing else:
    for verb in ("create", "delete", "patch", "list", "watch"):
        assert not can(rig, user, verb, "leases.coordination.k8s.io", namespace), verb
    for verb in ("get", "update"):
        assert not can(rig, user, verb, "leases.coordination.k8s.io", other), verb
    assert not can(rig, user, "patch", "tasks.retex.dev", namespace, subresource="status")
    assert not can(rig, user, "update", "tasks.retex.dev", namespace, subresource="status")
    assert not can(rig, user, "get", "tasks.retex.dev", namespace)
    for verb in ("get", "list", "watch"):
        assert not can(rig, user, verb, "secrets", namespace), verb
    assert not can(rig, user, "create", "pods", namespace)

    # Real calls with a token of the worker's ServiceAccount.
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "probe"},
             "spec": {"leaseDurationSeconds": 15}}
    for ns in (namespace, other):
        rig.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(lease))
    task = task_manifest("probe", [{"name": "only", "exec": {"command": ["true"]}}])
    rig.kubectl("apply", "-n", namespace, "-f", "-", input=task)
    token = service_account_kubeconfig(rig.kubectl, rig.kubeconfig, namespace, "retex-worker", tmp_path / "worker")
    run_kubectl(token, "get", "-n", namespace, "lease", "probe")  # the token works where it should
    refused(token, "patch", "-n", namespace, "task", "probe", "--subresource=status", "--type=merge",
            "-p", '{"status": {"phase": "Succeeded", "ledgerVersion": 999}}')
    refused(token, "get", "-n", namespace, "secret", "retex-worker-db")
    refused(token, "get", "-n", other, "lease", "probe")
    stolen = {**lease, "metadata": {"name": "probe", "namespace": other}, "spec": {"holderIdentity": "thief:1"}}
    refused(token, "replace", "-f", "-", input=json.dumps(stolen))


def test_the_operator_cannot_read_secrets_or_get_pods_nor_hold_leases(rig, tenants, tmp_path):
    _, namespace, _ = tenants
    for verb, resource, subresource in [("get", "secrets", None), ("list", "secrets", None),
                                        ("get", "pods", None), ("create", "pods", None),
                                        ("update", "leases.coordination.k8s.io", None),
                                        ("get", "leases.coordination.k8s.io", None),
                                        ("delete", "tasks.retex.dev", None), ("update", "tasks.retex.dev", None),
                                        ("update", "jobs.batch", None), ("list", "namespaces", None),
                                        ("create", "roles.rbac.authorization.k8s.io", None)]:
        assert not can(rig, OPERATOR, verb, resource, namespace, subresource), (verb, resource)
    # What it reads of pods, across namespaces: the list and the watch of worker pods.
    assert all(can(rig, OPERATOR, verb, "pods", None, None) for verb in ("list", "watch"))
    kubeconfig = service_account_kubeconfig(rig.kubectl, rig.kubeconfig, "retex-system", "retex-operator",
                                            tmp_path / "operator.kubeconfig")
    refused(kubeconfig, "get", "-n", namespace, "secret", "retex-worker-db")
    refused(kubeconfig, "get", "-n", namespace, "pod", "any-pod")
