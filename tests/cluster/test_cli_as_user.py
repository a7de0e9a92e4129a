"""The CLI acts as a Kubernetes user: `retex requeue` patches annotations on the
Task with the user's own kubeconfig, RBAC decides whether they may, the API server vouches for the
name (SelfSubjectReview, and the ValidatingAdmissionPolicy retex-requested-by in manifests/base),
and the operator records that name in the ledger's history. Users here are ServiceAccounts with
tokens of their own: the API server authenticates and authorizes them as it would any user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.dev import service_account_kubeconfig
from e2e.rig.controlplane import run_kubectl
from e2e.system import task_manifest, wait_for

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "manifests" / "base" / "requested-by-policy.yaml"
BIN = Path(sys.executable).parent


def cli(kubeconfig: Path, *args: str, script: str = "retex") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RETEX_DATABASE_URL", "KUBECONFIG")}
    return subprocess.run([str(BIN / script), *args, "--kubeconfig", str(kubeconfig)], env=env,
                          capture_output=True, text=True, timeout=60)


def user(retex, tmp_path, name: str, verbs: list[str]) -> tuple[Path, str]:
    """A ServiceAccount `name` with `verbs` on tasks (and reading Events) in the test's namespace;
    a kubeconfig with its token."""
    namespace = retex.namespace
    retex.kubectl("create", "serviceaccount", name)
    retex.kubectl("create", "role", f"{name}-tasks", f"--verb={','.join(verbs)}", "--resource=tasks.retex.dev")
    retex.kubectl("create", "rolebinding", f"{name}-tasks", f"--role={name}-tasks",
                  f"--serviceaccount={namespace}:{name}")
    kubeconfig = service_account_kubeconfig(retex.rig.kubectl, retex.rig.kubeconfig, namespace, name,
                                            tmp_path / f"{name}.kubeconfig")
    return kubeconfig, f"system:serviceaccount:{namespace}:{name}"


@pytest.fixture
def failed_task(retex):
    """The policy installed (cluster-scoped, as manifests/base ships it) and a Task that failed."""
    retex.rig.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(POLICY))
    steps = [{"name": "only", "exec": {"command": ["sh", "-c", "exit 3"]}, "permanentExitCodes": [3]}]
    retex.kubectl("apply", "-f", "-", input=task_manifest("broken", steps, retry={"maxAttempts": 1}))
    retex.kubectl("wait", "--for=jsonpath={.status.phase}=Failed", "--timeout=90s", "task/broken", timeout=100)
    return json.loads(retex.kubectl("get", "task", "broken", "-o", "json").stdout)["metadata"]["uid"]


def requeues(retex, uid: str) -> list[str]:
    return [h.actor for h in retex.ledger.history(uid) if h.event == "requeue"]


def test_a_user_allowed_to_patch_tasks_requeues_through_the_api_and_the_ledger_records_their_name(
        retex, failed_task, tmp_path):
    kubeconfig, alice = user(retex, tmp_path, "alice", ["get", "patch"])
    done = cli(kubeconfig, "requeue", "broken", "-n", retex.namespace, script="kubectl-retex")
    assert done.returncode == 0, done.stderr
    assert f"requested as {alice}" in done.stdout
    wait_for(lambda: requeues(retex, failed_task), timeout=30, what="the requeue in the ledger")
    assert requeues(retex, failed_task) == [f"kube:{alice}"]


def test_a_user_without_the_right_to_patch_tasks_is_refused_with_what_is_missing(retex, failed_task, tmp_path):
    kubeconfig, bob = user(retex, tmp_path, "bob", ["get"])
    done = cli(kubeconfig, "requeue", "broken", "-n", retex.namespace)
    assert done.returncode == 1 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.startswith(f"retex: you may not requeue task {retex.namespace}/broken (patch on tasks.retex.dev)")
    assert f'User "{bob}" cannot patch resource "tasks"' in done.stderr
    assert "Ask an administrator" in done.stderr
    assert requeues(retex, failed_task) == []


def test_a_requeue_naming_another_user_is_refused_by_the_api_server(retex, failed_task, tmp_path):
    kubeconfig, alice = user(retex, tmp_path, "mallory", ["get", "patch"])
    forged = ["annotate", "-n", retex.namespace, "task", "broken", "retex.dev/requeue=now",
              "retex.dev/requested-by=system:serviceaccount:kube-system:admin"]

    def refused_by_policy():
        result = run_kubectl(kubeconfig, *forged, check=False)
        return result.returncode != 0 and "retex-requested-by" in result.stderr and result.stderr

    message = wait_for(refused_by_policy, timeout=30, what="the policy refusing a forged name")  # once it is loaded
    assert f"retex.dev/requested-by={alice}" in message and "use `retex requeue`" in message
    # Without the annotation at all: refused too. The admin (system:masters) is held to it as well.
    assert "retex-requested-by" in run_kubectl(kubeconfig, "annotate", "-n", retex.namespace, "task", "broken",
                                               "retex.dev/requeue=again", check=False).stderr
    by_admin = retex.kubectl("annotate", "task", "broken", "retex.dev/requeue=x",
                             "retex.dev/requested-by=someone-else", check=False)
    assert by_admin.returncode != 0 and "retex-requested-by" in by_admin.stderr, by_admin.stderr
    assert requeues(retex, failed_task) == []


def test_a_user_resolves_a_step_through_the_api_and_the_task_ends_with_their_name_in_the_ledger(
        retex, stubs, tmp_path):
    _, notifier = stubs
    retex.rig.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(POLICY))
    # Attempt 1's worker dies right after the notify effect (neither idempotent nor verifiable):
    # attempt 2 stops the task for a human (as in test_policies).
    manifest = {"apiVersion": "retex.dev/v1alpha1", "kind": "Task",
                "metadata": {"name": "needs-human", "annotations": {"retex.dev/failpoint": "after-effect:notify"}},
                "spec": {"lease": {"durationSeconds": 5}, "steps": [
                    {"name": "notify", "http": {"method": "POST", "url": f"{notifier.url}/effects/notify"},
                     "timeoutSeconds": 5},
                    {"name": "after", "idempotent": True, "exec": {"command": ["sh", "-c", "echo after"]}}]}}
    retex.kubectl("create", "-f", "-", input=json.dumps(manifest))
    retex.kubectl("wait", "--for=jsonpath={.status.phase}=NeedsAttention", "--timeout=90s", "task/needs-human",
                  timeout=100)
    uid = json.loads(retex.kubectl("get", "task", "needs-human", "-o", "json").stdout)["metadata"]["uid"]

    kubeconfig, alice = user(retex, tmp_path, "alice", ["get", "patch"])
    done = cli(kubeconfig, "resolve", "needs-human", "-n", retex.namespace, "--step", "notify", "--mark-done",
               "--result", '{"found_by": "support"}')
    assert done.returncode == 0, done.stderr
    retex.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=60s", "task/needs-human", timeout=70)
    resolved = [h for h in retex.ledger.history(uid) if h.event == "step-resolve-done"]
    assert [h.actor for h in resolved] == [f"kube:{alice}"]
    assert notifier.for_task(uid)["notify"]["executions"] == 1  # marked done, never run again


def test_a_user_cannot_rewrite_the_operators_record_of_what_it_handled_to_replay_anothers_request(
        retex, failed_task, tmp_path):
    """kopf keeps what it last handled under kopf.retex.dev/: emptied, an earlier requeue or resolve
    would look new and be handled again, in its first author's name. Only the operator writes it."""
    kubeconfig, mallory = user(retex, tmp_path, "mallory", ["get", "patch"])
    annotations = json.loads(retex.kubectl("get", "task", "broken", "-o", "json").stdout)["metadata"]["annotations"]
    kopf_keys = [k for k in annotations if k.startswith("kopf.retex.dev/")]
    assert kopf_keys, annotations  # the operator has handled this task: its record is there
    for change in ([f"{kopf_keys[0]}={{}}", "--overwrite"], [f"{kopf_keys[0]}-"], ["kopf.retex.dev/forged=1"]):
        done = run_kubectl(kubeconfig, "annotate", "-n", retex.namespace, "task", "broken", *change, check=False)
        assert done.returncode != 0, change
        assert "are the retex operator's own record of what it handled" in done.stderr and mallory in done.stderr
    after = json.loads(retex.kubectl("get", "task", "broken", "-o", "json").stdout)["metadata"]["annotations"]
    assert {k: after.get(k) for k in kopf_keys} == {k: annotations[k] for k in kopf_keys}
    assert requeues(retex, failed_task) == []


def test_a_cluster_admin_outside_system_masters_may_change_the_operators_record(retex, failed_task):
    """kubeadm's admin.conf (kind's, and most clusters' since Kubernetes 1.29) is in the group
    kubeadm:cluster-admins, bound to cluster-admin, not in system:masters: RBAC says who is an admin."""
    group = f"test-cluster-admins-{retex.namespace}"
    retex.rig.kubectl("create", "clusterrolebinding", group, "--clusterrole=cluster-admin", f"--group={group}")
    try:
        # A key under kopf.retex.dev/ the operator does not use: the policy guards them all alike.
        done = retex.kubectl("annotate", "task", "broken", "kopf.retex.dev/admin-note=1", "--as=carol",
                             f"--as-group={group}", check=False)
        assert done.returncode == 0, done.stderr
        after = json.loads(retex.kubectl("get", "task", "broken", "-o", "json").stdout)["metadata"]["annotations"]
        assert after["kopf.retex.dev/admin-note"] == "1"
    finally:
        retex.rig.kubectl("delete", "clusterrolebinding", group, check=False)
