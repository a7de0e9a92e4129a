"""retex itself on a cluster, for scenarios: the CRD, a tenant namespace with the worker's RBAC,
and the operator as a local process that tests can kill and restart.

Used by the cluster tests, the crash-matrix suite and `make dev`; the same calls work against the
local rig or (through RETEX_KUBECONFIG) an external cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.postgres import free_port
from e2e.rig import pki as pkilib
from e2e.rig.controlplane import wait_for as rig_wait_for

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "tasks.retex.dev.yaml"
TENANT = REPO / "manifests" / "tenant"
# The admission policies shipped in manifests/base: the TaskPolicy CRD and what it enforces on
# Tasks, and the one that keeps a worker to its own Lease (docs/security.md).
TASK_POLICY = REPO / "manifests" / "base" / "task-policy.yaml"
LEASE_POLICY = REPO / "manifests" / "base" / "lease-policy.yaml"
# The label the operator's watches select by is kept to the objects retex makes.
WORKER_LABEL_POLICY = REPO / "manifests" / "base" / "worker-label-policy.yaml"
# The operator's finalizer on each Task at its creation (Kubernetes 1.36 and later; the chart
# binds it to the namespaces the operator serves).
FINALIZER_POLICY = REPO / "manifests" / "finalizer-at-create" / "task-finalizer-policy.yaml"
FINALIZER = "retex.dev/finalizer"
# The suite's tenant namespaces: their tests choose images, ServiceAccounts and placement freely
# (an unpullable image, a ServiceAccount without Lease rights, a node that does not exist).
# tests/cluster/test_tenancy_policy.py proves the policy with namespaces of its own.
ANY_TASK_POLICY = {"apiVersion": "retex.dev/v1alpha1", "kind": "TaskPolicy", "metadata": {"name": "default"},
                   "spec": {"images": ["*"], "serviceAccountNames": ["*"], "tolerationKeys": ["*"],
                            "nodeSelectorKeys": ["*"]}}
DEFAULT_TASK_POLICY = TENANT / "task-policy-default.yaml"


def default_task_policy(*, images: list[str] | None = None) -> dict[str, Any]:
    """The shipped default TaskPolicy of a tenant namespace, allowing `images` besides."""
    policy = yaml.safe_load(DEFAULT_TASK_POLICY.read_text())
    if images:
        policy["spec"] = {**policy["spec"], "images": images}
    return policy


# How the API server refuses a Task in a namespace without a TaskPolicy `default`, and before it
# has found the TaskPolicy kind at all.
NO_TASK_POLICY = "no params found for policy binding"
POLICY_NOT_CONFIGURED = "failed to configure policy"
LEADER_ELECTION_FOR_TESTS = {"RETEX_LEADER_LEASE_SECONDS": "4", "RETEX_LEADER_RENEW_DEADLINE_SECONDS": "3",
                             "RETEX_LEADER_RETRY_SECONDS": "0.5"}


def install_crd(kubectl) -> None:
    """The Task CRD and, as every cluster runs retex, the admission policies of manifests/base."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    wait_established(kubectl, "tasks.retex.dev")
    install_policies(kubectl)


def install_policies(kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(TASK_POLICY), "-f", str(LEASE_POLICY),
            "-f", str(WORKER_LABEL_POLICY))
    wait_established(kubectl, "taskpolicies.retex.dev")


def wait_established(kubectl, crd: str) -> None:
    """Poll the CRD until it is Established. Not `kubectl wait`: right after an apply it failed a
    few times on a fresh rig (under load) where a poll of the object
    itself only waits."""
    def established():
        got = kubectl("get", "crd", crd, "-o", "json", check=False)
        if got.returncode != 0:
            return None, got.stderr.strip()[:200]
        status = json.loads(got.stdout).get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or []}  # null right after the create
        return conditions.get("Established", {}).get("status") == "True", str(conditions.get("Established"))
    rig_wait_for(f"CRD {crd} Established", established, 60)


def prepare_namespace(kubectl, namespace: str, task_policy: dict[str, Any] | None = ANY_TASK_POLICY) -> None:
    """A namespace where Tasks may run, onboarded as docs/install.md says (manifests/tenant): the
    worker ServiceAccount and its Role, the operator's RoleBinding, the workers' NetworkPolicy —
    and `task_policy` as its TaskPolicy instead of the shipped default (None: no TaskPolicy). No
    credentials: workers reach the ledger through the operator's endpoint with their pod's token."""
    manifest = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    kubectl("apply", "-f", "-", input=json.dumps(manifest))
    onboarding = [doc for doc in yaml.safe_load_all(kubectl("kustomize", str(TENANT)).stdout)
                  if doc and doc.get("kind") != "TaskPolicy"]
    kubectl("apply", "--server-side", "--force-conflicts", "-n", namespace, "-f", "-",
            input=yaml.safe_dump_all(onboarding))
    if task_policy is not None:
        apply_task_policy(kubectl, namespace, task_policy)


def discard_namespace(kubectl, namespace: str) -> None:
    """Delete a test's namespace without waiting, its Tasks' finalizers taken off first: with no
    operator left to run their delete handlers they would hold the namespace in Terminating for
    good, and a later cluster-wide operator would find those Tasks (seen: the RBAC test's operator
    refusing another test's leftovers, namespaces it was never granted)."""
    names = kubectl("get", "tasks", "-n", namespace, "-o", "name", check=False).stdout.split()
    for name in names:
        kubectl("patch", "-n", namespace, name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
    kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def apply_task_policy(kubectl, namespace: str, policy: dict[str, Any]) -> None:
    """Apply `policy` in a namespace that had none, and wait until the API server judges Tasks by
    it: its admission plugin finds the TaskPolicy kind (a CRD just established) and then the
    TaskPolicies themselves through caches, a moment behind. Until then a Task (here a dry run) is
    refused: "failed to configure policy: failed to find resource referenced by paramKind", then
    "no params found" (both seen failing tests that created a Task right after)."""
    install_policies(kubectl)  # the TaskPolicy kind, and what judges Tasks by it
    kubectl("apply", "--server-side", "--force-conflicts", "-n", namespace, "-f", "-", input=json.dumps(policy))

    def in_force():
        refusal = dry_run_task(kubectl, namespace, "policy-probe").stderr
        return not any(sign in refusal for sign in (NO_TASK_POLICY, POLICY_NOT_CONFIGURED)), refusal.strip()[-200:]
    rig_wait_for(f"the TaskPolicy of {namespace} in force", in_force, 30)


def serves_mutating_policies(kubectl) -> bool:
    """Whether the API server serves MutatingAdmissionPolicy in v1 (GA in Kubernetes 1.36), what
    the shipped policy is written in; the beta (1.34, off by default) does not count."""
    group = kubectl("get", "--raw", "/apis/admissionregistration.k8s.io/v1", check=False)
    if group.returncode != 0:
        return False
    return any(r["name"] == "mutatingadmissionpolicies" for r in json.loads(group.stdout)["resources"])


def bind_finalizer_policy(kubectl, namespace: str) -> str:
    """manifests/finalizer-at-create's policy, bound to `namespace` alone as the chart binds it to
    watchNamespaces (apply_finalizer_policy)."""
    policy, binding = [doc for doc in yaml.safe_load_all(FINALIZER_POLICY.read_text()) if doc]
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [namespace]}]}}
    return apply_finalizer_policy(kubectl, [policy, binding], namespace)


def apply_finalizer_policy(kubectl, objects: list[dict[str, Any]], namespace: str) -> str:
    """The finalizer policy and its binding (`objects`, bound to `namespace`), both renamed for that
    namespace: the suite's other namespaces keep kopf's own finalizer PATCH, and no object is left
    for helm to refuse (test_chart_on_rig installs the chart's). Waits until a Task created there (a
    dry run) carries the finalizer; returns the name, for unbind_finalizer_policy."""
    policy, binding = (next(o for o in objects if o["kind"] == kind)
                       for kind in ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"))
    name = f"{policy['metadata']['name']}-{namespace}"
    policy["metadata"]["name"] = binding["metadata"]["name"] = binding["spec"]["policyName"] = name
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all([policy, binding]))

    def in_force():
        created = dry_run_task(kubectl, namespace, "finalizer-probe", "-o", "json")
        if created.returncode != 0:
            return False, created.stderr.strip()[-200:]
        finalizers = json.loads(created.stdout)["metadata"].get("finalizers") or []
        return FINALIZER in finalizers, f"finalizers {finalizers}"
    rig_wait_for(f"the finalizer policy bound to {namespace}", in_force, 30)
    return name


def unbind_finalizer_policy(kubectl, name: str) -> None:
    kubectl("delete", "mutatingadmissionpolicybinding", name, "--ignore-not-found")
    kubectl("delete", "mutatingadmissionpolicy", name, "--ignore-not-found")


class OperatorProcess:
    """`retex-operator` as a child process with its own log file."""

    def __init__(self, kubeconfig: Path, dsn: str, log_path: Path, *, extra_env: dict[str, str] | None = None,
                 ledger_tls: pkilib.Pki | None = None, pod_host: str = "127.0.0.1",
                 worker_image: str = "retex-worker:local"):
        """`pod_host`: where the cluster's pods reach this host (the rig's loopback; the kind
        network's gateway); `worker_image`: the workers' image (the rig runs the installed project)."""
        self.kubeconfig, self.dsn, self.log_path = kubeconfig, dsn, log_path
        self.extra_env = extra_env or {}
        self.pod_host, self.worker_image = pod_host, worker_image
        self.proc: subprocess.Popen | None = None
        self.metrics_port = free_port()
        self.ledger_port = free_port()
        self.health_port = free_port()
        # The ledger endpoint serves TLS as deployed; its workers get the CA through their Jobs.
        # Replicas share one (`ledger_tls`), as they mount one Secret.
        self.ledger_tls = ledger_tls or pkilib.ledger_serving(log_path.parent / f"{log_path.stem}-ledger-tls", pod_host)

    @classmethod
    def on(cls, rig: Any, dsn: str, log_path: Path, *, kubeconfig: Path | None = None, **kwargs: Any) -> OperatorProcess:
        """An operator for `rig` (the local rig or a kind cluster): its workers run the rig's worker
        image and reach this host where the rig's pods can (`pod_host`). `kubeconfig`: the rig's
        admin one unless given (a test running the operator as its ServiceAccount)."""
        return cls(kubeconfig or rig.kubeconfig, dsn, log_path, pod_host=rig.pod_host, worker_image=rig.worker_image,
                   **kwargs)

    def start(self, **env: str) -> None:
        environment = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "RETEX_DATABASE_URL": self.dsn,
            # The throwaway Postgres of tests and `make dev` serves no TLS (docs/security.md).
            "RETEX_DATABASE_INSECURE": "1",
            "RETEX_WORKER_IMAGE": self.worker_image,
            "RETEX_LEDGER_PORT": str(self.ledger_port),
            "RETEX_LEDGER_URL": f"https://{self.pod_host}:{self.ledger_port}",
            "RETEX_LEDGER_TLS_CERT_FILE": str(self.ledger_tls.crt("ledger")),
            "RETEX_LEDGER_TLS_KEY_FILE": str(self.ledger_tls.key("ledger")),
            "RETEX_LEDGER_CA_FILE": str(self.ledger_tls.ca_crt),
            "RETEX_WORKER_GRACE_SECONDS": "10",
            "RETEX_RESYNC_SECONDS": "5",
            "RETEX_METRICS_PORT": str(self.metrics_port),
            # Leader election: a killed operator's successor (a new identity) waits out the lease
            # duration, so tests that restart operators keep it short.
            **LEADER_ELECTION_FOR_TESTS,
            **self.extra_env,
            **env,
        }
        # The election Lease lives in the operator's namespace: the test's own namespace when the
        # operator was made for one (so tests never share an election, and a restart unscoped
        # still elects where its predecessor did), else retex-system as deployed.
        scoped = [ns for ns in (self.extra_env.get("RETEX_NAMESPACES") or environment.get("RETEX_NAMESPACES", "")).split(",")
                  if ns]
        environment.setdefault("RETEX_OPERATOR_NAMESPACE", scoped[0] if scoped else "retex-system")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "retex-operator"), "--health", f"http://127.0.0.1:{self.health_port}"],
            env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def kill(self) -> None:
        """kill -9: the operator gets no chance to tidy up."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:  # its stop joins its loops, then gives up its leadership: it can outlast 20 s
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self, **env: str) -> None:
        self.kill()
        self.start(**env)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def probe(self, path: str) -> tuple[int, str]:
        """(status, body) of the health endpoint's `path` (/readyz, /livez)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}{path}", timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read().decode()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Its metrics page, each sample by (name, sorted labels)."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as answer:
            text = answer.read().decode()
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    def leader_gauge(self) -> float | None:
        """`retex_leader`: 1 while it leads, 0 standing by; None while its page does not answer."""
        try:
            return self.metrics().get(("retex_leader", ()))
        except OSError:
            return None

    def wait_leading(self, timeout: float = 60) -> None:
        """Until it leads: it alone writes, every loop running."""
        rig_wait_for("the operator leading", lambda: self.leader_gauge() == 1, timeout,
                     abort=lambda: None if self.exited() is None else f"the operator exited ({self.exited()})")

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def request_requeue(kubectl, task: str, value: str) -> str:
    """Annotate a Task for a requeue as the kubeconfig's user, naming that user as the policy
    retex-requested-by (manifests/base) requires; returns the name, which the ledger records as
    `kube:<name>`."""
    user = kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout.strip()
    kubectl("annotate", "--overwrite", "task", task, f"retex.dev/requeue={value}", f"retex.dev/requested-by={user}")
    return user


def dry_run_task(kubectl, namespace: str, name: str, *args: str) -> subprocess.CompletedProcess:
    """A one-step Task created in `namespace` as a server-side dry run (`args`: kubectl's more): what
    the API server's admission makes of it, and nothing stored."""
    probe = task_manifest(name, [{"name": "only", "exec": {"command": ["true"]}}])
    return kubectl("create", "-n", namespace, "--dry-run=server", *args, "-f", "-", input=probe, check=False)


def task_manifest(name: str, steps: list[dict[str, Any]], **spec: Any) -> str:
    return yaml.safe_dump({"apiVersion": "retex.dev/v1alpha1", "kind": "Task", "metadata": {"name": name},
                           "spec": {"steps": steps, **spec}})


def wait_for(predicate, *, timeout: float, interval: float = 0.25, what: str = "condition"):
    """The rig's poller (progress every few seconds, RigError on timeout) with the keyword order
    scenarios read best in."""
    return rig_wait_for(what, predicate, timeout, interval=interval)


