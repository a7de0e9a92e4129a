"""Past the start deadline, a worker pod is failed only when what keeps it from starting does not
clear by itself; a pod that is only slow (pulling, waiting for capacity or a throttling quota) waits."""

import pytest

from retex.operator.starting import start_verdict


def pod(*, waiting=None, scheduled=None, phase="Pending", init_waiting=None, node_selector=None):
    status = {"phase": phase}
    if waiting:
        status["containerStatuses"] = [{"name": "worker", "state": {"waiting": dict(zip(("reason", "message"), waiting, strict=True))}}]
    if init_waiting:
        status["initContainerStatuses"] = [{"name": "init", "state": {"waiting": {"reason": init_waiting}}}]
    if scheduled:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": scheduled}]
    return {"metadata": {"name": "job-abc"}, "spec": {"nodeSelector": node_selector} if node_selector else {},
            "status": status}


def failed_create(message, at="2026-01-01T00:00:00Z"):
    return {"reason": "FailedCreate", "message": message, "lastTimestamp": at}


@pytest.mark.parametrize("reason", ["CreateContainerConfigError", "InvalidImageName", "ErrImagePull",
                                    "ImagePullBackOff", "CreateContainerError", "CrashLoopBackOff"])
def test_a_container_waiting_for_a_human_is_stuck(reason):
    verdict = start_verdict([pod(waiting=(reason, "details"))], [])
    assert verdict.stuck
    assert verdict.why == f"{reason}: details"


@pytest.mark.parametrize("reason", ["ContainerCreating", "PodInitializing"])
def test_a_container_still_being_created_or_pulled_is_slow(reason):
    verdict = start_verdict([pod(waiting=(reason, "pulling image"))], [])
    assert not verdict.stuck
    assert verdict.why == "pod job-abc is Pending"


def test_an_init_container_that_cannot_start_is_stuck():
    assert start_verdict([pod(init_waiting="ImagePullBackOff")], []).stuck


def test_an_unknown_waiting_reason_is_not_taken_for_stuck():
    verdict = start_verdict([pod(waiting=("SomethingNew", ""))], [])
    assert (verdict.stuck, verdict.why) == (False, "SomethingNew")


@pytest.mark.parametrize("message", [
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. preemption: 0/3 nodes "
    "are available: 3 Preemption is not helpful for scheduling.",
    "0/2 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 1 node(s) didn't match "
    "node selector.",
])
def test_a_pod_no_node_can_ever_match_is_stuck(message):
    verdict = start_verdict([pod(scheduled=message)], [])
    assert verdict.stuck
    assert verdict.why.startswith("Unschedulable: 0/")


@pytest.mark.parametrize("message", [
    "0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available: 1 No preemption "
    "victims found for incoming pod.",
    "0/3 nodes are available: 1 Insufficient memory, 2 node(s) didn't match Pod's node affinity/selector.",
    "0/2 nodes are available: 2 Too many pods.",
    "0/1 nodes are available: 1 node(s) were unschedulable.",
    "0/1 nodes are available: 1 node(s) had untolerated taint {node.kubernetes.io/not-ready: }.",
    "no nodes available to schedule pods",
])
def test_a_pod_waiting_for_capacity_or_for_a_node_is_slow(message):
    verdict = start_verdict([pod(scheduled=message)], [])
    assert not verdict.stuck
    assert verdict.why == f"Unschedulable: {message}"


def test_a_quota_smaller_than_the_pod_alone_is_stuck():
    message = ('Error creating: pods "job-abc-x" is forbidden: exceeded quota: no-pods, requested: pods=1, '
               "used: pods=0, limited: pods=0")
    verdict = start_verdict([], [failed_create(message)])
    assert verdict.stuck
    assert verdict.why == f"FailedCreate: {message}"


@pytest.mark.parametrize("message", [
    'Error creating: pods "job-abc-x" is forbidden: exceeded quota: throttle, requested: pods=1, used: pods=5, '
    "limited: pods=5",
    'Error creating: pods "job-abc-x" is forbidden: exceeded quota: compute, requested: limits.cpu=500m,pods=1, '
    "used: limits.cpu=2,pods=3, limited: limits.cpu=2,pods=10",
])
def test_a_quota_used_up_by_other_pods_is_a_throttle_and_slow(message):
    assert not start_verdict([], [failed_create(message)]).stuck


def test_a_quota_below_the_pods_own_request_in_any_resource_is_stuck():
    message = ('Error creating: pods "job-abc-x" is forbidden: exceeded quota: compute, requested: '
               "limits.memory=2Gi,pods=1, used: limits.memory=0,pods=0, limited: limits.memory=1Gi,pods=10")
    assert start_verdict([], [failed_create(message)]).stuck


def test_a_policy_refusal_is_stuck_and_an_unreachable_webhook_is_not():
    forbidden = 'Error creating: pods "job-abc-x" is forbidden: violates PodSecurity "restricted:latest"'
    unreachable = 'Error creating: Internal error occurred: failed calling webhook "x": connection refused'
    assert start_verdict([], [failed_create(forbidden)]).stuck
    assert not start_verdict([], [failed_create(unreachable)]).stuck


def test_the_latest_refusal_is_the_one_judged():
    old = failed_create('pods "a" is forbidden: violates PodSecurity', at="2026-01-01T00:00:00Z")
    new = failed_create("Internal error occurred: failed calling webhook", at="2026-01-01T00:01:00Z")
    assert not start_verdict([], [old, new]).stuck


def test_a_job_with_no_pod_and_no_word_why_is_slow():
    assert start_verdict([], []) == start_verdict([], [{"reason": "SuccessfulCreate"}])
    assert start_verdict([], []).why == "no pod of the Job started"
    assert not start_verdict([], []).stuck


# kind, kubeadm and most clusters: the control plane's node is tainted, and the scheduler names the
# first filter a node fails, so it never says whether that node matched the selector.
BESIDE_A_TAINTED_CONTROL_PLANE = ("0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 node(s) didn't "
                                  "match Pod's node affinity/selector. preemption: 0/3 nodes are available: 3 "
                                  "Preemption is not helpful for scheduling.")


def test_a_node_selector_no_node_has_is_stuck_even_where_a_tainted_node_hides_the_mismatch():
    asked = []

    def labelled(selector):
        asked.append(selector)
        return False

    verdict = start_verdict([pod(scheduled=BESIDE_A_TAINTED_CONTROL_PLANE, node_selector={"disk": "nvme"})], [],
                            node_labelled=labelled)
    assert verdict.stuck, verdict.why
    assert "no node is labelled disk=nvme" in verdict.why
    assert asked == [{"disk": "nvme"}]


def test_a_node_selector_some_node_has_leaves_a_tainted_or_full_cluster_slow():
    verdict = start_verdict([pod(scheduled=BESIDE_A_TAINTED_CONTROL_PLANE, node_selector={"disk": "nvme"})], [],
                            node_labelled=lambda selector: True)
    assert not verdict.stuck


@pytest.mark.parametrize("message", [
    "no nodes available to schedule pods",  # none at all for now
    "0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 Insufficient cpu.",  # capacity
    "0/2 nodes are available: 2 node(s) had untolerated taint(s).",  # a pool tainted, or not ready
])
def test_a_node_selector_no_node_has_now_is_slow_where_the_scheduler_names_no_mismatch(message):
    """No node of those labels now, but none was excluded for a mismatch either: an empty cluster,
    a pool being replaced or scaled from zero by an autoscaler. Nodes are not even asked for."""
    asked = []
    verdict = start_verdict([pod(scheduled=message, node_selector={"disk": "nvme"})], [],
                            node_labelled=lambda selector: asked.append(selector) or False)
    assert not verdict.stuck, verdict.why
    assert asked == []
