"""Waiting on pods and Jobs from tests, with progress (see e2e.rig.controlplane.wait_for)."""

from __future__ import annotations

from kubernetes import client

from e2e.rig import procs
from e2e.rig.controlplane import wait_for


def pod_or_none(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    try:
        return core.read_namespaced_pod(name, namespace)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def wait_pod_phase(core: client.CoreV1Api, namespace: str, name: str, *phases: str,
                   timeout: float = 30) -> client.V1Pod:
    def reached():
        pod = pod_or_none(core, namespace, name)
        phase = pod.status.phase if pod is not None else "(absent)"
        return (pod if phase in phases else None), f"phase {phase}"
    return wait_for(f"pod {namespace}/{name} {'/'.join(phases)}", reached, timeout)


def wait_pod_gone(core: client.CoreV1Api, namespace: str, name: str, uid: str | None = None,
                  timeout: float = 30) -> None:
    def gone():
        pod = pod_or_none(core, namespace, name)
        return pod is None or (uid is not None and pod.metadata.uid != uid)
    wait_for(f"pod {namespace}/{name} deleted", gone, timeout)


def container_pid(pod: client.V1Pod, index: int = 0) -> int:
    """The host PID of a running container on the rig (containerID is rig://<pid>)."""
    container_id = pod.status.container_statuses[index].container_id
    assert container_id and container_id.startswith("rig://"), container_id
    return int(container_id.removeprefix("rig://"))


def job_condition(batch: client.BatchV1Api, namespace: str, name: str) -> str | None:
    """The Job's terminal condition type (Complete/Failed) once it is True, else None."""
    job = batch.read_namespaced_job(name, namespace)
    for condition in job.status.conditions or []:
        if condition.type in ("Complete", "Failed") and condition.status == "True":
            return condition.type
    return None


def wait_job_finished(batch: client.BatchV1Api, namespace: str, name: str,
                      timeout: float = 60) -> str:
    return wait_for(f"job {namespace}/{name} finished",
                    lambda: job_condition(batch, namespace, name), timeout)


def job_pods(core: client.CoreV1Api, namespace: str, job: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(namespace, label_selector=f"batch.kubernetes.io/job-name={job}").items


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie awaiting its reaper counts as exited)."""
    return procs.is_zombie(pid)
