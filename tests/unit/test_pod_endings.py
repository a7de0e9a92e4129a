"""The pod watch's record of ended worker pods (retex.kube.podwatch): a pod counts as ended only
when the kubelet reported every container terminated in a final phase, and only for its own Job;
a pod newly seen ending wakes the reaper."""

import pytest
from kubernetes import client

from retex.kube.podwatch import PodEndings


def controlled_by_job(job):
    return [{"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": f"uid-of-{job}", "controller": True}]


def pod(name, phase, state, *, job="job-1", namespace="ns", owners=None):
    return {"metadata": {"name": name, "namespace": namespace, "labels": {"job-name": job},
                         "ownerReferences": controlled_by_job(job) if owners is None else owners},
            "status": {"phase": phase, "containerStatuses": [{"name": "worker", "state": state}]}}


KILLED = {"terminated": {"exitCode": 137}}
RUNNING = {"running": {"startedAt": "2026-12-06T09:00:00Z"}}


def test_a_listed_pod_counts_as_ended_only_when_its_containers_were_reported_terminated():
    seen = PodEndings(client.ApiClient())
    seen.listed([pod("a", "Failed", KILLED), pod("b", "Running", RUNNING), pod("c", "Failed", RUNNING),
                 pod("d", "Succeeded", {"terminated": {"exitCode": 0}})])
    assert [seen.ended("ns", "job-1", name) for name in "abcd"] == [True, False, False, True]


def test_an_ended_pod_counts_for_its_own_job_and_namespace_only():
    seen = PodEndings(client.ApiClient())
    seen.changed("MODIFIED", pod("a", "Failed", KILLED))
    assert seen.ended("ns", "job-1", "a")
    assert not seen.ended("ns", "job-2", "a") and not seen.ended("other", "job-1", "a")


@pytest.mark.parametrize("owners", [
    [],
    [{**controlled_by_job("job-1")[0], "controller": False}],
    [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "job-1", "uid": "u", "controller": True}],
], ids=["no-owner", "job-not-its-controller", "another-kind"])
def test_a_pod_that_no_job_controls_is_not_a_worker_whatever_its_labels(owners):
    """Belt and braces for a cluster without the label's admission policy: a tenant's own pod
    carrying the worker labels is not taken for a worker that ended."""
    wakes = []
    seen = PodEndings(client.ApiClient())
    seen.on_ended = lambda: wakes.append(1)
    seen.listed([pod("a", "Failed", KILLED, owners=owners)])
    seen.changed("MODIFIED", pod("b", "Failed", KILLED, owners=owners))
    assert not seen.ended("ns", "job-1", "a") and not seen.ended("ns", "job-1", "b")
    assert wakes == []


def test_a_deleted_pod_or_a_new_one_of_the_same_name_is_no_longer_ended():
    seen = PodEndings(client.ApiClient())
    seen.changed("MODIFIED", pod("a", "Failed", KILLED))
    seen.changed("DELETED", pod("a", "Failed", KILLED))
    assert not seen.ended("ns", "job-1", "a")
    seen.changed("MODIFIED", pod("a", "Failed", KILLED))
    seen.changed("ADDED", pod("a", "Pending", {"waiting": {"reason": "ContainerCreating"}}))
    assert not seen.ended("ns", "job-1", "a")


def test_a_relist_replaces_what_was_seen_before():
    seen = PodEndings(client.ApiClient())
    seen.changed("MODIFIED", pod("a", "Failed", KILLED))
    seen.listed([pod("b", "Failed", KILLED)])
    assert not seen.ended("ns", "job-1", "a") and seen.ended("ns", "job-1", "b")


def test_a_pod_seen_ending_wakes_the_reaper_once_and_a_relist_wakes_it_for_endings_the_watch_missed():
    wakes = []
    seen = PodEndings(client.ApiClient())
    seen.on_ended = lambda: wakes.append(1)
    seen.changed("MODIFIED", pod("a", "Running", RUNNING))
    assert wakes == []
    seen.changed("MODIFIED", pod("a", "Failed", KILLED))
    seen.changed("MODIFIED", pod("a", "Failed", KILLED))  # the same end again (a later status write)
    assert len(wakes) == 1
    seen.listed([pod("a", "Failed", KILLED)])  # a relist that finds nothing new
    assert len(wakes) == 1
    seen.listed([pod("a", "Failed", KILLED), pod("b", "Failed", KILLED)])  # b ended while the watch was down
    assert len(wakes) == 2
    seen.changed("DELETED", pod("b", "Failed", KILLED))
    assert len(wakes) == 2


def never_restarted(body, policy="Never"):
    return {**body, "spec": {"restartPolicy": policy}}


def test_a_pod_that_is_never_restarted_counts_as_ended_once_its_containers_are_reported_terminated_before_its_phase():
    """A kubelet writes the pod's terminal phase only once it has torn the pod down (a second or
    more after the container's exit, kubernetes#108366); the container's terminated state, as the
    runtime reported it, comes first, and with restartPolicy Never it is final."""
    seen = PodEndings(client.ApiClient())
    seen.changed("MODIFIED", never_restarted(pod("a", "Running", RUNTIME_EXIT)))
    assert seen.ended("ns", "job-1", "a")


def test_a_terminated_container_that_may_restart_does_not_count_while_the_phase_is_not_final():
    seen = PodEndings(client.ApiClient())
    seen.listed([never_restarted(pod("a", "Running", KILLED), "OnFailure"), pod("b", "Running", KILLED)])
    assert not seen.ended("ns", "job-1", "a") and not seen.ended("ns", "job-1", "b")


RUNTIME_EXIT = {"terminated": {"exitCode": 137, "reason": "Error", "containerID": "containerd://abc",
                               "finishedAt": "2026-12-06T09:00:01Z"}}


def test_a_container_the_kubelet_could_not_find_is_no_end_before_the_phase_is_final():
    """`ContainerStatusUnknown` is the kubelet's guess when the runtime did not answer for a
    running container (after a containerd restart, say): its processes may still run. Only the
    terminal phase, written after the kubelet killed the pod, says so then."""
    unknown = {"terminated": {"exitCode": 137, "reason": "ContainerStatusUnknown",
                              "message": "The container could not be located when the pod was terminated"}}
    seen = PodEndings(client.ApiClient())
    seen.changed("MODIFIED", never_restarted(pod("a", "Running", unknown)))
    assert not seen.ended("ns", "job-1", "a")
    seen.changed("MODIFIED", never_restarted(pod("a", "Failed", unknown)))
    assert seen.ended("ns", "job-1", "a")


@pytest.mark.parametrize("spec, status", [
    ({"shareProcessNamespace": True}, {}),
    ({"containers": [{"name": "worker", "restartPolicy": "OnFailure"}]}, {}),
    ({}, {"initContainerStatuses": [{"name": "mesh-proxy", "state": RUNNING}]}),
    ({}, {"ephemeralContainerStatuses": [{"name": "debugger", "state": RUNNING}]}),
], ids=["shared-process-namespace", "container-restart-policy", "sidecar-running", "ephemeral-running"])
def test_a_pod_where_something_else_may_still_run_waits_for_its_final_phase(spec, status):
    """The containers' terminated state is final only for a pod whose worker container owns its
    PID namespace (its exit killed every process in it), restarts no container on its own, and
    runs nothing else (a sidecar could still send the dead worker's request)."""
    body = pod("a", "Running", RUNTIME_EXIT)
    body = {**body, "spec": {"restartPolicy": "Never", **spec}, "status": {**body["status"], **status}}
    seen = PodEndings(client.ApiClient())
    seen.changed("MODIFIED", body)
    assert not seen.ended("ns", "job-1", "a")
    seen.changed("MODIFIED", {**body, "status": {**body["status"], "phase": "Failed"}})
    assert seen.ended("ns", "job-1", "a")


def test_the_first_list_after_a_start_logs_no_line_per_pod_that_failed_long_ago(caplog):
    seen = PodEndings(client.ApiClient())
    with caplog.at_level("INFO", logger="retex.kube.podwatch"):
        seen.listed([pod(f"p{i}", "Failed", KILLED) for i in range(50)])
    assert "worker pod failed" not in caplog.text
