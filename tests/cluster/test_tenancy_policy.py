"""What a Task may ask for, and what its worker may touch, on the rig's real API server: a
namespace's TaskPolicy decides the images, ServiceAccounts, placement, step
kinds and http destinations of its Tasks; a worker pod may update only its own task's Lease; an
object squatting on the name of a task's Lease or Job ends the task instead of being adopted.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import kubernetes.config
import pytest
import yaml
from kubernetes import client

from e2e.attempt_identity import pending_attempt_pod
from e2e.system import (
    NO_TASK_POLICY,
    default_task_policy,
    discard_namespace,
    install_crd,
    prepare_namespace,
    task_manifest,
    wait_for,
)
from retex.api.models import MSG_SPEC_TOO_LARGE, SPEC_MAX_BYTES, TaskSpec
from retex.kube.errors import ApiError
from retex.kube.leases import Holder, acquired, read_lease, released, renewed, replace_lease
from retex.kube.objects import LABEL_TASK_UID, WorkerDefaults, build_job, build_lease, lease_name
from retex.kube.rest import Credentials, RestClient
from retex.operator.admission import admission_for


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



def test_a_spec_over_the_size_cap_in_python_args_is_stored_by_the_api_server_and_refused_by_the_operator(retex):
    """CEL cannot measure free-form JSON: the API server stores the Task, the operator refuses it
    with a message saying what to do, and nothing runs."""
    steps = [{"name": "big", "python": {"callable": "m:f", "args": {"blob": "x" * (SPEC_MAX_BYTES + 1)}}}]
    retex.kubectl("create", "-f", "-", input=task_manifest("too-big", steps))  # create: apply's annotation is capped
    wait_for(lambda: condition(retex, "too-big", "Accepted").get("reason") == "InvalidSpec", timeout=60,
             what="too-big refused as InvalidSpec")
    assert (task(retex, "too-big").get("status") or {}).get("phase") == "Refused"
    assert MSG_SPEC_TOO_LARGE in condition(retex, "too-big", "Accepted")["message"]
    uid = task(retex, "too-big")["metadata"]["uid"]
    assert not retex.kubectl("get", "jobs", "-l", f"{LABEL_TASK_UID}={uid}", "-o", "name").stdout.strip()

# --- item 3: what a Task may ask for is its namespace's TaskPolicy ------------------------------

STRICT, PLAIN, ANY = "policy-strict", "policy-plain", "policy-any"
EXEC = [{"name": "only", "exec": {"command": ["true"]}}]


@pytest.fixture(scope="module")
def policies(rig):
    """Three namespaces: one without a TaskPolicy, one with the shipped default, one with a
    policy allowing any image, ServiceAccount and placement."""
    install_crd(rig.kubectl)
    prepare_namespace(rig.kubectl, STRICT, task_policy=None)
    prepare_namespace(rig.kubectl, PLAIN, task_policy=default_task_policy())
    prepare_namespace(rig.kubectl, ANY)
    yield rig
    for namespace in (STRICT, PLAIN, ANY):
        discard_namespace(rig.kubectl, namespace)


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
    assert "retex-namespace-not-onboarded.run.kubectl-apply-n-ns-k-manifests-tenant" in message, message


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
        "spec": {"images": ["registry.example.com/team/", "other.example/w@sha256:" + "a" * 64, "shop-worker:"],
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
        admitted(policies, namespace, "a-tag", worker={"image": "shop-worker:2"})
        # "shop-worker:" allows that repository's tags, not a registry host shop-worker on some port.
        assert "spec.worker.image shop-worker:5000/evil is not allowed" in refused(
            policies, namespace, "host-port", worker={"image": "shop-worker:5000/evil"})
        assert "spec.worker.serviceAccountName retex-worker is not allowed" in refused(
            policies, namespace, "named-default-account", worker={"serviceAccountName": "retex-worker"})
        message = refused(policies, namespace, "http", [{"name": "a", "http": {"method": "GET", "url": "https://x.example/"}}])
        assert "namespace policy-named allows only these step kinds (its TaskPolicy's stepKinds): exec, python" in message
        message = refused(policies, namespace, "http-verify", [{"name": "a", "exec": {"command": ["true"]},
                                                               "verify": {"http": {"method": "GET", "url": "https://x.example/"}}}])
        assert "allows only these step kinds" in message, message
    finally:
        discard_namespace(policies.kubectl, namespace)


def test_a_taskpolicy_entry_by_digest_must_name_a_whole_digest(policies):
    """`reg/x@sha256:` would allow every digest of reg/x: an entry by digest is a whole one."""
    policy = {"apiVersion": "retex.dev/v1alpha1", "kind": "TaskPolicy", "metadata": {"name": "default"},
              "spec": {"images": ["reg.example/x@sha256:"]}}
    result = policies.kubectl("apply", "--dry-run=server", "-n", "default", "-f", "-", input=json.dumps(policy),
                              check=False)
    assert result.returncode != 0 and "a whole reference by digest" in result.stderr, result.stderr


def test_no_taskpolicy_lets_an_http_step_call_link_local_or_metadata_addresses(policies):
    for url in ["http://169.254.169.254/latest/meta-data/iam/", "http://169.254.170.2/v2/credentials",
                "http://[fe80::a9fe:a9fe]/", "http://[::ffff:169.254.169.254]/", "http://[fd00:ec2::254]/", "http://100.100.100.200/latest/meta-data/",
                "http://metadata.google.internal/computeMetadata/v1/", "http://METADATA/"]:
        for steps in ([{"name": "a", "http": {"method": "GET", "url": url}}],
                      [{"name": "a", "exec": {"command": ["true"]}, "verify": {"http": {"method": "GET", "url": url}}}]):
            message = refused(policies, ANY, "metadata", steps)
            assert ("http steps may not call link-local or cloud metadata addresses (169.254.0.0/16, fe80::/10, "
                    f"metadata.google.internal and the like), whatever the TaskPolicy: {url}") in message, message
    admitted(policies, ANY, "loopback-and-private", [
        {"name": "a", "http": {"method": "GET", "url": "http://127.0.0.1:8080/"}},
        {"name": "b", "http": {"method": "GET", "url": "http://10.0.0.1/"}}])


# --- item 4: a worker may update only its own task's Lease --------------------------------------

LEASES, OTHER_LEASES = "lease-tenant", "lease-other"


@pytest.fixture(scope="module")
def lease_api(rig):
    install_crd(rig.kubectl)
    for namespace in (LEASES, OTHER_LEASES):
        prepare_namespace(rig.kubectl, namespace)
    with rig.api_client() as api:
        yield api
    for namespace in (LEASES, OTHER_LEASES):
        discard_namespace(rig.kubectl, namespace)


@dataclass
class Attempt:
    """A task with its Lease as the operator creates it, and a worker pod of one of its attempts
    holding the token the kubelet gives it (bound to the pod, for the API server). No operator
    runs here: nothing else touches the Lease."""

    namespace: str
    name: str
    uid: str
    epoch: int
    pod: str
    kubeconfig: Path  # the worker pod's

    @functools.cached_property
    def api(self) -> client.ApiClient:
        """The kubernetes client, as the worker pod."""
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    @functools.cached_property
    def lease_client(self) -> RestClient:
        """The worker's own client (retex.kube.rest), as the worker pod: the Lease calls go through it."""
        return RestClient(Credentials.from_kubeconfig(str(self.kubeconfig)))

    @property
    def lease(self) -> str:
        return lease_name(self.name, self.uid)

    @property
    def me(self) -> Holder:
        return Holder(self.pod, self.epoch)


def attempt(rig, admin: client.ApiClient, namespace: str, name: str, tmp_path: Path, epoch: int = 1,
            uid: str | None = None) -> Attempt:
    if uid is None:
        rig.kubectl("create", "-n", namespace, "-f", "-", input=task_manifest(name, EXEC))
        uid = json.loads(rig.kubectl("get", "-n", namespace, "task", name, "-o", "json").stdout)["metadata"]["uid"]
        client.CoordinationV1Api(admin).create_namespaced_lease(namespace, build_lease(
            task_name=name, task_uid=uid, namespace=namespace, duration_seconds=15))
    job = build_job(task_name=name, task_uid=uid, namespace=namespace, epoch=epoch,
                    spec=TaskSpec.model_validate({"steps": EXEC}),
                    defaults=WorkerDefaults(image="retex-worker:local", service_account="retex-worker",
                                            ledger_url="http://unused"))
    pod = pending_attempt_pod(admin, job)
    token = client.CoreV1Api(admin).create_namespaced_service_account_token(
        "retex-worker", namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid)))).status.token
    return Attempt(namespace, name, uid, epoch, pod.metadata.name, token_kubeconfig(rig, token, tmp_path / f"{pod.metadata.name}.kubeconfig"))


def token_kubeconfig(rig, token: str, path: Path) -> Path:
    admin = yaml.safe_load(Path(rig.kubeconfig).read_text())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "worker",
        "clusters": [{"name": "rig", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": "worker", "user": {"token": token}}],
        "contexts": [{"name": "worker", "context": {"cluster": "rig", "user": "worker"}}]}))
    return path


def write(by: Attempt, of: Attempt, change) -> dict:
    """`by`'s pod reads `of`'s Lease and writes `change(lease)` back, as the worker does."""
    body = read_lease(by.lease_client, of.namespace, of.lease, timeout=10)
    return replace_lease(by.lease_client, of.namespace, of.lease, change(body), timeout=10)


def forbidden(by: Attempt, of: Attempt, change) -> str:
    with pytest.raises(ApiError) as refusal:
        write(by, of, change)
    assert refusal.value.status == 403, refusal.value
    return json.loads(refusal.value.body)["message"]


def holder(admin: client.ApiClient, of: Attempt) -> str | None:
    return client.CoordinationV1Api(admin).read_namespaced_lease(of.lease, of.namespace).spec.holder_identity


def now():
    return datetime.now(UTC)


def test_a_worker_pod_cannot_take_renew_or_release_another_tasks_lease_but_keeps_its_own(rig, lease_api, tmp_path):
    x = attempt(rig, lease_api, LEASES, "order-x", tmp_path)
    y = attempt(rig, lease_api, LEASES, "order-y", tmp_path)
    write(y, y, lambda body: acquired(body, y.me, 15, now()))  # Y's worker holds its Lease

    not_its_task = f"pod {x.pod} is not a worker of the task that owns Lease {y.lease}"
    assert not_its_task in forbidden(x, y, lambda body: acquired(body, x.me, 15, now()))  # take it
    assert not_its_task in forbidden(x, y, lambda body: renewed(body, now()))  # keep a dead Y looking alive
    assert not_its_task in forbidden(x, y, lambda body: released(body, now()))  # condemn a live Y
    assert holder(lease_api, y) == y.me.identity

    # Its own Lease, as the worker's protocol writes it: taken, renewed, released.
    write(x, x, lambda body: acquired(body, x.me, 15, now()))
    write(x, x, lambda body: renewed(body, now()))
    write(x, x, lambda body: released(body, now()))
    assert holder(lease_api, x) is None


def test_a_worker_pod_of_a_task_with_a_long_name_keeps_its_own_lease(rig, lease_api, tmp_path):
    """Task names of up to 253 characters are cut to fit 63 in the Lease name and, shorter still,
    in the Job name (which has the epoch to carry): the pod's name need not start with the Lease's."""
    long = attempt(rig, lease_api, LEASES, "a-very-long-order-name-" + "x" * 40, tmp_path)
    assert not long.pod.startswith(long.lease)
    write(long, long, lambda body: acquired(body, long.me, 15, now()))
    write(long, long, lambda body: renewed(body, now()))
    assert holder(lease_api, long) == long.me.identity


def test_a_worker_pod_writes_only_itself_as_holder_and_leaves_labels_owner_and_newer_attempts_alone(
        rig, lease_api, tmp_path):
    x = attempt(rig, lease_api, LEASES, "order-z", tmp_path)
    message = forbidden(x, x, lambda body: acquired(body, Holder("order-y-0123abcd-1-abcde", 1), 15, now()))
    assert f"pod {x.pod} may write only itself ({x.me.identity}) as the Lease's holder" in message, message

    def relabelled(body):
        body["metadata"]["labels"][LABEL_TASK_UID] = "another-task"
        return acquired(body, x.me, 15, now())
    assert "a worker may not change its Lease's labels or owner" in forbidden(x, x, relabelled)

    second = attempt(rig, lease_api, LEASES, "order-z", tmp_path, epoch=2, uid=x.uid)
    write(second, second, lambda body: acquired(body, second.me, 15, now()))
    message = forbidden(x, x, lambda body: acquired(body, x.me, 15, now()))
    assert f"is held by a newer attempt: {second.me.identity}" in message, message
    assert holder(lease_api, x) == second.me.identity


def test_a_worker_pod_cannot_touch_another_namespaces_lease_and_an_unbound_token_touches_none(
        rig, lease_api, tmp_path):
    x = attempt(rig, lease_api, LEASES, "order-w", tmp_path)
    elsewhere = attempt(rig, lease_api, OTHER_LEASES, "order-w", tmp_path)
    admin = RestClient(Credentials.from_kubeconfig(str(rig.kubeconfig)))
    with pytest.raises(ApiError) as refusal:  # the worker Role is its own namespace's only
        replace_lease(x.lease_client, OTHER_LEASES, elsewhere.lease, read_lease(admin, OTHER_LEASES, elsewhere.lease,
                                                                                timeout=10), timeout=10)
    assert refusal.value.status == 403 and "cannot update resource" in refusal.value.body
    # A token of the worker ServiceAccount that names no pod (kubectl create token) cannot stand in.
    unbound = token_kubeconfig(rig, rig.kubectl("create", "token", "retex-worker", "-n", LEASES).stdout.strip(),
                           tmp_path / "unbound.kubeconfig")
    anyone = Attempt(LEASES, x.name, x.uid, 1, "none", unbound)
    message = forbidden(anyone, x, lambda body: acquired(body, x.me, 15, now()))
    assert "a retex Lease may be updated only with a worker pod's own token" in message, message


def refused_delete(by: Attempt, of: Attempt) -> str | None:
    """The refusal's message once RBAC lets `by` delete (its cache may lag the new Role); None before."""
    with pytest.raises(client.ApiException) as refusal:
        client.CoordinationV1Api(by.api).delete_namespaced_lease(of.lease, of.namespace)
    assert refusal.value.status == 403, refusal.value
    message = json.loads(refusal.value.body)["message"]
    return None if "cannot delete resource" in message else message


def test_no_serviceaccount_but_the_collectors_deletes_a_retex_lease_even_with_rbac_to_delete_it(rig, lease_api, tmp_path):
    """A deleted Lease condemns a live worker: a ServiceAccount the namespace grants `delete` on
    Leases (the worker's, here) still cannot delete a retex Lease — not another task's, not its own."""
    x = attempt(rig, lease_api, LEASES, "order-d", tmp_path)
    y = attempt(rig, lease_api, LEASES, "order-e", tmp_path)
    write(y, y, lambda body: acquired(body, y.me, 15, now()))
    rbac = [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "lease-deleter"},
             "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["delete"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "lease-deleter"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lease-deleter"},
             "subjects": [{"kind": "ServiceAccount", "name": "retex-worker", "namespace": LEASES}]}]
    rig.kubectl("apply", "-n", LEASES, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac}))
    try:
        for target in (y, x):
            message = wait_for(lambda t=target: refused_delete(x, t), timeout=10, what="RBAC to allow the delete")
            assert "a retex Lease is deleted only with its Task" in message, message
        assert holder(lease_api, y) == y.me.identity
    finally:
        rig.kubectl("delete", "-n", LEASES, "role,rolebinding", "lease-deleter", check=False)
