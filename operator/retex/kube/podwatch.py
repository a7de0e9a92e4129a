"""Which worker pods have ended, as the kubelet reported them: one watch over every pod labelled
`retex.dev/task-uid`, recording the ended ones that a Job controls by namespace and name with
their Job.

The reaper asks it first about a lease holder: a holder whose pod ended (a worker killed or
crashed) needs no wait for a late renewal and no pod LIST before its attempt is replaced; the
reaper still confirms the Lease with a GET. A pod seen ending wakes the reaper (`on_ended`, which
the reaper sets), so the next attempt does not wait for its round either. While the watch is blind
or behind, the reaper's own look (a LIST of the Job's pods, once a renewal is late) decides as
before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client

from retex.kube.objects import LABEL_TASK_UID
from retex.kube.watching import ObjectKey, list_then_watch, object_key
from retex.logs import log_line

log = logging.getLogger(__name__)

def containers_terminated(pod: dict[str, Any]) -> bool:
    """The kubelet reported every container of the pod terminated, for good. Not the phase alone:
    the control plane marks the pods of a deleted Node Failed while their processes may still run
    on it. With a final phase (a kubelet writes it only once it has torn the pod down,
    kubernetes#108366) every terminated state counts; before it, on kind 1.2 s sooner
    (docs/benchmarks.md), only when nothing of the pod can still run (`_nothing_else_runs`) and
    every state is the runtime's report of an exit."""
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    if not containers or not all((c.get("state") or {}).get("terminated") for c in containers):
        return False
    if status.get("phase") in ("Failed", "Succeeded"):
        return True
    return _nothing_else_runs(pod) and all(_runtime_exit(c["state"]["terminated"]) for c in containers)


def _runtime_exit(terminated: dict[str, Any]) -> bool:
    """The container runtime reported the exit. Not the kubelet's `ContainerStatusUnknown`, its
    guess when the runtime did not answer for a running container (a containerd restart): that
    container's processes may still run."""
    return bool(terminated.get("containerID")) and terminated.get("reason") != "ContainerStatusUnknown"


def _nothing_else_runs(pod: dict[str, Any]) -> bool:
    """Once its containers exited, nothing of the pod can run a step's effect: it is never
    restarted (restartPolicy Never, as every worker's, and no container's own policy, KEP-5307),
    each container owns its PID namespace (its exit killed every process in it; a shared one's
    init is the pause container), and no sidecar or ephemeral container still runs (a mesh proxy
    could still send the dead worker's request)."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    others = (status.get("initContainerStatuses") or []) + (status.get("ephemeralContainerStatuses") or [])
    return (spec.get("restartPolicy") == "Never" and not spec.get("shareProcessNamespace")
            and not any(c.get("restartPolicy") for c in spec.get("containers") or [])
            and not any((c.get("state") or {}).get("running") for c in others))


def _job(pod: dict[str, Any]) -> str | None:
    """The Job that controls the pod (None: no Job does). A worker pod is the Job controller's;
    a pod that merely carries the worker labels (where the admission policy that keeps the label
    to worker pods was removed, manifests/base/worker-label-policy.yaml) is not a worker."""
    return next((owner["name"] for owner in pod["metadata"].get("ownerReferences") or []
                 if owner.get("controller") and owner.get("kind") == "Job"
                 and owner.get("apiVersion") == "batch/v1"), None)


class PodEndings:
    def __init__(self, api: client.ApiClient):
        self._core = client.CoreV1Api(api)
        self.on_ended: Callable[[], None] = lambda: None  # the reaper's wake; once per pod newly seen ended
        self._ended: dict[ObjectKey, str | None] = {}  # an ended pod → its Job
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def ended(self, namespace: str, job: str, pod: str) -> bool:
        """Whether the watch saw pod `namespace/pod` of Job `job` end."""
        with self._lock:
            return self._ended.get((namespace, pod)) == job

    def run(self) -> None:
        list_then_watch(self._core.list_pod_for_all_namespaces, label_selector=LABEL_TASK_UID, stopped=self._stop,
                        listed=self.listed, changed=self.changed, went_blind=lambda: None, what="worker pod")

    def stop(self) -> None:
        self._stop.set()

    def listed(self, pods: list[dict[str, Any]]) -> None:
        ended = {object_key(pod): _job(pod) for pod in pods if _job(pod) and containers_terminated(pod)}
        with self._lock:
            news = ended.items() - self._ended.items()  # ended while the watch was down
            self._ended = ended
        if news:  # not logged one by one: the first list finds every failed pod its Job's TTL keeps
            self.on_ended()

    def changed(self, kind: str, pod: dict[str, Any]) -> None:
        key, job = object_key(pod), _job(pod)
        with self._lock:
            if kind != "DELETED" and job and containers_terminated(pod):
                news = self._ended.get(key, object()) != job
                self._ended[key] = job
            else:  # gone, or (a new pod of the same name) not ended
                news = False
                self._ended.pop(key, None)
        if news:
            _log_if_failed(pod)
            self.on_ended()


def _log_if_failed(pod: dict[str, Any]) -> None:
    """When the operator learnt that a worker's container ended with an error (killed, crashed):
    the first stage of a recovery (`make bench` times it). A worker that exited 0 is not worth a line."""
    meta = pod["metadata"]
    codes = [((c.get("state") or {}).get("terminated") or {}).get("exitCode")
             for c in (pod.get("status") or {}).get("containerStatuses") or []]
    if any(codes):
        log_line(log, logging.INFO, "worker pod failed", uid=(meta.get("labels") or {}).get(LABEL_TASK_UID),
                 namespace=meta["namespace"], pod=meta["name"], job=_job(pod), exit_codes=codes)
