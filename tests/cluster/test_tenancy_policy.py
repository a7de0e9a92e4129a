"""What a Task may ask for, and what its worker may touch, on the rig's real API server (issue 14,
items 3, 4 and 7): a namespace's TaskPolicy decides the images, ServiceAccounts, placement, step
kinds and http destinations of its Tasks; a worker pod may update only its own task's Lease; an
object squatting on the name of a task's Lease or Job ends the task instead of being adopted.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from e2e.system import NO_TASK_POLICY, install_crd, prepare_namespace, task_manifest, wait_for
from retex.kube.objects import lease_name
from retex.operator.admission import admission_for

ROOT = Path(__file__).resolve().parents[2]


def task(system, name) -> dict:
    out = system.kubectl("get", "task", name, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def condition(system, name, kind) -> dict:
    conditions = (task(system, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def admitted_while_the_operator_is_down(system, name, steps) -> str:
    """A Task in the ledger with its first dispatch waiting, its uid known before any relay ran."""
    system.kubectl("create", "-f", "-", input=task_manifest(name, steps))
    meta = task(system, name)["metadata"]
    system.ledger.admit(admission_for(
        uid=meta["uid"], namespace=meta["namespace"], name=name, spec=task(system, name)["spec"],
        submitted_at=datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))))
    return meta["uid"]


def test_a_lease_name_held_by_a_lease_not_of_this_task_ends_the_task_and_is_left_alone(retex):
    retex.operator.kill()
    uid = admitted_while_the_operator_is_down(retex, "squatted", [{"name": "say", "exec": {"command": ["true"]}}])
    name = lease_name("squatted", uid)
    # Someone else's Lease under the name the operator will give this task's: holding it, renewed
    # by its owner. Adopting it would hand the task's liveness to whoever renews it.
    foreign = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
               "spec": {"holderIdentity": "someone-else:1", "leaseDurationSeconds": 3600}}
    retex.kubectl("create", "-f", "-", input=json.dumps(foreign))
    retex.operator.start()
    wait_for(lambda: (task(retex, "squatted").get("status") or {}).get("phase") == "Failed", timeout=60,
             what="squatted Failed")
    failed = condition(retex, "squatted", "Failed")
    assert failed["reason"] == "JobRejected", failed
    assert f'Lease "{name}" already exists and is not owned by this Task' in failed["message"], failed
    assert not retex.kubectl("get", "jobs", "-o", "name").stdout.strip()  # no worker was started on it
    lease = json.loads(retex.kubectl("get", "lease", name, "-o", "json").stdout)
    assert not lease["metadata"].get("ownerReferences") and lease["spec"]["holderIdentity"] == "someone-else:1"


# --- item 3: what a Task may ask for is its namespace's TaskPolicy ------------------------------

DEFAULT_POLICY = ROOT / "manifests" / "base" / "task-policy-default.yaml"
STRICT, PLAIN, ANY = "policy-strict", "policy-plain", "policy-any"
EXEC = [{"name": "only", "exec": {"command": ["true"]}}]


@pytest.fixture(scope="module")
def policies(rig):
    """Three namespaces: one without a TaskPolicy, one with the shipped default, one with a
    policy allowing any image, ServiceAccount and placement."""
    install_crd(rig.kubectl)
    prepare_namespace(rig.kubectl, STRICT, task_policy=None)
    prepare_namespace(rig.kubectl, PLAIN, task_policy=yaml.safe_load(DEFAULT_POLICY.read_text()))
    prepare_namespace(rig.kubectl, ANY)
    yield rig
    for namespace in (STRICT, PLAIN, ANY):
        rig.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def create(rig, namespace: str, name: str, steps=EXEC, **spec):
    return rig.kubectl("create", "-n", namespace, "-f", "-", input=task_manifest(name, steps, **spec), check=False)


def refused(rig, namespace: str, name: str, steps=EXEC, **spec) -> str:
    """The API server's refusal of the Task, after checking that nothing was stored."""
    result = create(rig, namespace, name, steps, **spec)
    assert result.returncode != 0, f"{name} was admitted in {namespace}"
    assert rig.kubectl("get", "-n", namespace, "task", name, check=False).returncode != 0
    return result.stderr


def admitted(rig, namespace: str, name: str, steps=EXEC, **spec) -> None:
    result = create(rig, namespace, name, steps, **spec)
    assert result.returncode == 0, result.stderr


def test_a_namespace_without_a_taskpolicy_runs_no_tasks_and_the_refusal_names_what_is_missing(policies):
    message = refused(policies, STRICT, "plain")
    assert NO_TASK_POLICY in message, message
    assert "retex-tasks-need-the-taskpolicy-default-of-their-namespace" in message, message


def test_the_default_taskpolicy_allows_the_operators_worker_only_and_says_so(policies):
    admitted(policies, PLAIN, "plain", [{"name": "a", "exec": {"command": ["true"]}},
                                        {"name": "b", "python": {"callable": "m:f"}},
                                        {"name": "c", "http": {"method": "GET", "url": "https://example.com/x"}}])
    message = refused(policies, PLAIN, "own-image", worker={"image": "evil.example/steal:1"})
    assert ("spec.worker.image evil.example/steal:1 is not allowed in namespace policy-plain: its TaskPolicy "
            "allows no image but the operator's; leave spec.worker.image out") in message, message
    message = refused(policies, PLAIN, "other-account", worker={"serviceAccountName": "default"})
    assert ("spec.worker.serviceAccountName default is not allowed in namespace policy-plain: its TaskPolicy "
            "allows no ServiceAccount but the operator's") in message, message
    # Scheduling onto the control plane: tolerate its taint (or every taint), or select its nodes.
    for name, tolerations in [("control-plane", [{"key": "node-role.kubernetes.io/control-plane",
                                                  "operator": "Exists", "effect": "NoSchedule"}]),
                              ("every-taint", [{"operator": "Exists"}])]:
        message = refused(policies, PLAIN, name, worker={"tolerations": tolerations})
        assert ("spec.worker.tolerations may name only the taint keys the TaskPolicy of namespace policy-plain "
                "allows (none)") in message, message
    message = refused(policies, PLAIN, "select-control-plane",
                      worker={"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}})
    assert "spec.worker.nodeSelector may use only the label keys the TaskPolicy of namespace policy-plain" in message


def test_a_taskpolicy_allows_what_it_names_and_nothing_else(policies):
    namespace = "policy-named"
    prepare_namespace(policies.kubectl, namespace, task_policy={
        "apiVersion": "retex.dev/v1alpha1", "kind": "TaskPolicy", "metadata": {"name": "default"},
        "spec": {"images": ["registry.example.com/team/", "other.example/w@sha256:" + "a" * 64],
                 "serviceAccountNames": ["payments"], "tolerationKeys": ["dedicated"],
                 "nodeSelectorKeys": ["pool"], "stepKinds": ["exec", "python"]}})
    try:
        admitted(policies, namespace, "allowed", worker={
            "image": "registry.example.com/team/worker:2", "serviceAccountName": "payments",
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "retex", "effect": "NoSchedule"}],
            "nodeSelector": {"pool": "batch"}})
        admitted(policies, namespace, "by-digest", worker={"image": "other.example/w@sha256:" + "a" * 64})
        assert "spec.worker.image registry.example.com/team-evil/w:1 is not allowed" in refused(
            policies, namespace, "neighbour-prefix", worker={"image": "registry.example.com/team-evil/w:1"})
        assert "spec.worker.image other.example/w:latest is not allowed" in refused(
            policies, namespace, "by-tag", worker={"image": "other.example/w:latest"})
        assert "spec.worker.serviceAccountName retex-worker is not allowed" in refused(
            policies, namespace, "named-default-account", worker={"serviceAccountName": "retex-worker"})
        message = refused(policies, namespace, "http", [{"name": "a", "http": {"method": "GET", "url": "https://x.example/"}}])
        assert "namespace policy-named allows only these step kinds (its TaskPolicy's stepKinds): exec, python" in message
        message = refused(policies, namespace, "http-verify", [{"name": "a", "exec": {"command": ["true"]},
                                                               "verify": {"http": {"method": "GET", "url": "https://x.example/"}}}])
        assert "allows only these step kinds" in message, message
    finally:
        policies.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_no_taskpolicy_lets_an_http_step_call_link_local_or_metadata_addresses(policies):
    for url in ["http://169.254.169.254/latest/meta-data/iam/", "http://169.254.170.2/v2/credentials",
                "http://[fe80::a9fe:a9fe]/", "http://[::ffff:169.254.169.254]/", "http://[fd00:ec2::254]/",
                "http://metadata.google.internal/computeMetadata/v1/", "http://METADATA/"]:
        for steps in ([{"name": "a", "http": {"method": "GET", "url": url}}],
                      [{"name": "a", "exec": {"command": ["true"]}, "verify": {"http": {"method": "GET", "url": url}}}]):
            message = refused(policies, ANY, "metadata", steps)
            assert ("http steps may not call link-local or cloud metadata addresses (169.254.0.0/16, fe80::/10, "
                    f"metadata.google.internal and the like), whatever the TaskPolicy: {url}") in message, message
    admitted(policies, ANY, "loopback-and-private", [
        {"name": "a", "http": {"method": "GET", "url": "http://127.0.0.1:8080/"}},
        {"name": "b", "http": {"method": "GET", "url": "http://10.0.0.1/"}}])

