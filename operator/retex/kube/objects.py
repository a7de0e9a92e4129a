"""Pure builders of the objects the operator creates for an attempt: its Job and its Lease.

No API calls here: given a dispatch and the operator's settings, return the body to send.
Unit-tested without a cluster (tests/unit/test_kube_objects.py).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from retex.api import API_VERSION, KIND, TaskSpec
from retex.ledger import spec_hash
from retex.ledger.wire import TOKEN_AUDIENCE

LABEL_TASK_UID = "retex.dev/task-uid"
LABEL_EPOCH = "retex.dev/epoch"
# On a Task, arms a worker failpoint in its FIRST attempt only, and only when the operator runs
# with RETEX_FAILPOINTS_FROM_ANNOTATIONS=1 (test rigs): the crash matrix's way into a worker.
FAILPOINT_ANNOTATION = "retex.dev/failpoint"
MANAGED_BY = {"app.kubernetes.io/managed-by": "retex"}

# Lease names are DNS labels (a Task name may have 253 characters). Job names are shorter still:
# the Job controller names its pods `<job>-<5 chars>` with the base cut at 58 characters, and the
# lease policy (manifests/base/lease-policy.yaml) reads a worker pod's task and epoch from the end
# of that name, so the whole Job name and its dash must fit 58.
_NAME_LIMIT = 63
_JOB_NAME_LIMIT = 57
# The worker's token for the ledger endpoint: projected, bound to the pod, for one audience only,
# rotated by the kubelet. The worker reads it at every call (retex.worker.ledger_client).
LEDGER_TOKEN_DIR = "/var/run/secrets/retex"
LEDGER_TOKEN_PATH = "ledger-token"
LEDGER_TOKEN_SECONDS = 3600


@dataclass(frozen=True)
class WorkerDefaults:
    """Operator settings that shape every worker Pod unless the Task's spec.worker says otherwise."""

    image: str
    service_account: str
    ledger_url: str  # the operator's ledger endpoint, as worker pods reach it
    ledger_ca: str | None = None  # PEM of the CA of the endpoint's certificate (public), for https
    termination_grace_seconds: int = 30
    ttl_after_finished_seconds: int = 600
    # How long a worker pod stays bound to a NotReady/unreachable node before it is evicted. The
    # next attempt does not wait for this (the lease does that); it only tidies the old pod.
    lost_node_toleration_seconds: int = 10
    run_as_user: int = 65532
    # A step that writes without bound must not fill its node's disk: the scratch volume and the
    # container's writable layer are capped unless the Task's resources name ephemeral-storage.
    scratch_size_limit: str = "1Gi"
    ephemeral_storage_limit: str = "2Gi"


def _short(uid: str) -> str:
    return hashlib.sha256(uid.encode()).hexdigest()[:8]


def _prefix(task_name: str, room: int) -> str:
    """The task name as a DNS label fragment of at most `room` characters."""
    label = re.sub(r"[^a-z0-9-]", "-", task_name.lower())[:room].strip("-")
    return label or "task"


def lease_name(task_name: str, task_uid: str) -> str:
    """One Lease per task, shared by its attempts: `<name>-<hash of uid>`, at most 63 characters."""
    suffix = f"-{_short(task_uid)}"
    return _prefix(task_name, _NAME_LIMIT - len(suffix)) + suffix


def job_name(task_name: str, task_uid: str, epoch: int) -> str:
    """One Job per attempt, deterministic so a repeated dispatch meets AlreadyExists."""
    suffix = f"-{_short(task_uid)}-{epoch}"
    return _prefix(task_name, _JOB_NAME_LIMIT - len(suffix)) + suffix


def owner_reference(task_name: str, task_uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": task_name, "uid": task_uid,
            "controller": True, "blockOwnerDeletion": True}


def build_lease(*, task_name: str, task_uid: str, namespace: str, duration_seconds: int) -> dict[str, Any]:
    """The attempt's Lease, created free; the worker of each epoch takes it (see retex.kube.leases)."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": lease_name(task_name, task_uid),
            "namespace": namespace,
            "labels": {LABEL_TASK_UID: task_uid, **MANAGED_BY},
            "ownerReferences": [owner_reference(task_name, task_uid)],
        },
        "spec": {"leaseDurationSeconds": duration_seconds},
    }


def build_job(*, task_name: str, task_uid: str, namespace: str, epoch: int, spec: TaskSpec,
              defaults: WorkerDefaults, active_deadline_seconds: int | None = None,
              avoid_node: str | None = None, failpoint: str | None = None) -> dict[str, Any]:
    """The Job of attempt `epoch`. Retries belong to retex, so the Job itself never retries.

    `avoid_node` is where the previous attempt ran: the scheduler is asked to prefer another node,
    because a node that just lost an attempt may be dead but not yet NotReady.
    `failpoint` arms a crash point in the worker (crash-matrix tests only; see FAILPOINT_ANNOTATION)."""
    worker = spec.worker
    labels = {LABEL_TASK_UID: task_uid, LABEL_EPOCH: str(epoch), "app.kubernetes.io/component": "worker",
              **MANAGED_BY}
    env = [
        {"name": "RETEX_TASK_UID", "value": task_uid},
        {"name": "RETEX_TASK_NAMESPACE", "value": namespace},
        {"name": "RETEX_TASK_NAME", "value": task_name},
        {"name": "RETEX_EPOCH", "value": str(epoch)},
        # What the Job was built from (the live Task): the worker runs no other spec.
        {"name": "RETEX_SPEC_HASH", "value": spec_hash(spec.as_admitted())},
        {"name": "RETEX_LEASE_NAME", "value": lease_name(task_name, task_uid)},
        {"name": "RETEX_LEASE_DURATION_SECONDS", "value": str(spec.lease.duration_seconds)},
        {"name": "RETEX_LEDGER_URL", "value": defaults.ledger_url},
        *([{"name": "RETEX_LEDGER_CA", "value": defaults.ledger_ca}] if defaults.ledger_ca else []),
        {"name": "RETEX_LEDGER_TOKEN_FILE", "value": f"{LEDGER_TOKEN_DIR}/{LEDGER_TOKEN_PATH}"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "TMPDIR", "value": "/tmp"},
        # The running step may finish after SIGTERM, leaving time to commit and release the Lease.
        {"name": "RETEX_DRAIN_SECONDS", "value": str(max(1, defaults.termination_grace_seconds - 5))},
    ]
    if failpoint:
        env.append({"name": "RETEX_FAILPOINT", "value": failpoint})
    # Secret values the steps name reach the worker as env from secretKeyRef: the kubelet resolves
    # them, so they sit in neither the Task, the Job, nor the ledger; the worker hands each step
    # only its own (retex.worker.supervision).
    env += [{"name": ref.env_name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
            for ref in spec.secret_refs()]
    container: dict[str, Any] = {
        "name": "worker",
        "image": (worker and worker.image) or defaults.image,
        "command": ["retex-worker"],
        "env": env,
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"},
                         {"name": "ledger-token", "mountPath": LEDGER_TOKEN_DIR, "readOnly": True}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
        },
    }
    resources = worker.resources.model_dump(by_alias=True, exclude_none=True) if worker and worker.resources else {}
    if not any("ephemeral-storage" in (resources.get(kind) or {}) for kind in ("requests", "limits")):
        resources["limits"] = {**(resources.get("limits") or {}), "ephemeral-storage": defaults.ephemeral_storage_limit}
    container["resources"] = resources
    lost_node = [
        {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": defaults.lost_node_toleration_seconds}
        for taint in ("not-ready", "unreachable")
    ]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": (worker and worker.service_account_name) or defaults.service_account,
        # No Service environment variables: a Service named retex-<x> in the namespace would set
        # RETEX_<X>_PORT and the like, the worker's own settings' prefix.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": defaults.termination_grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": defaults.run_as_user,
            "runAsGroup": defaults.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "scratch", "emptyDir": {"sizeLimit": defaults.scratch_size_limit}},
            {"name": "ledger-token", "projected": {"sources": [{"serviceAccountToken": {
                "audience": TOKEN_AUDIENCE, "expirationSeconds": LEDGER_TOKEN_SECONDS, "path": LEDGER_TOKEN_PATH}}]}},
        ],
        "tolerations": lost_node + [
            t.model_dump(by_alias=True, exclude_none=True) for t in ((worker and worker.tolerations) or [])
        ],
    }
    if worker and worker.node_selector:
        pod_spec["nodeSelector"] = dict(worker.node_selector)
    if avoid_node:
        pod_spec["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "preference": {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [avoid_node]}]},
        }]}}
    job_spec: dict[str, Any] = {
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": defaults.ttl_after_finished_seconds,
        "template": {"metadata": {"labels": labels}, "spec": pod_spec},
    }
    if active_deadline_seconds:
        job_spec["activeDeadlineSeconds"] = active_deadline_seconds
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(task_name, task_uid, epoch),
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": [owner_reference(task_name, task_uid)],
        },
        "spec": job_spec,
    }
