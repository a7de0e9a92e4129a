"""Why a worker pod has not started, and whether that can clear by itself.

Past the start deadline the reaper fails an attempt only when its pod is *stuck*: the cause needs a
human (a missing Secret, an image that cannot be pulled, a node selector no node matches, a
quota smaller than the pod alone). A pod that is only *slow* (a long image pull, an autoscaler
scale-up, nodes or a quota full for now) keeps waiting: the task's timeout or a cancel still end it.
A pod asking for more than any node has is judged slow too: the scheduler says "Insufficient cpu"
for it exactly as for a full node, and an autoscaler may add a bigger one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Container waiting reasons that only mean "still starting" (an image pull in progress included).
_STARTING = {"ContainerCreating", "PodInitializing"}
# Container waiting reasons that do not clear without a change by a human. An image pull failure
# is retried by the kubelet, but by the deadline it has persisted for the whole deadline.
_STUCK_WAITING = {"CreateContainerConfigError", "CreateContainerError", "InvalidImageName", "ErrImageNeverPull",
                  "ErrImagePull", "ImagePullBackOff", "RunContainerError", "CrashLoopBackOff"}
# The scheduler's per-node reasons that no change of load or node count can clear.
_NODE_MISMATCH = ("didn't match Pod's node affinity/selector", "didn't match Pod's node affinity",
                  "didn't match node selector")
# "exceeded quota: q, requested: limits.cpu=2,pods=1, used: limits.cpu=0,pods=0, limited: limits.cpu=1,pods=10"
_QUOTA = re.compile(r"requested: (?P<requested>\S+), used: \S+, limited: (?P<limited>\S+)")


@dataclass(frozen=True)
class StartVerdict:
    stuck: bool  # True: fail the attempt; False: wait (slow, or not known to be stuck)
    why: str  # what Kubernetes says, for lastError and the log


def start_verdict(pods: list[dict[str, Any]], events: list[dict[str, Any]], *,
                  node_labelled: Callable[[dict[str, str]], bool] = lambda selector: True) -> StartVerdict:
    """Judge a Job whose worker has not taken its lease by the start deadline, from its pods and
    the Job's events as the kubelet, the scheduler and the Job controller report them.
    `node_labelled(selector)`: whether any node carries all those labels. The scheduler's message
    alone cannot say it where a node is tainted (a control plane's, in most clusters): it names
    only the first filter a node fails."""
    stuck: list[str] = []
    slow: list[str] = []
    for pod in pods:
        status = pod.get("status") or {}
        for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason and reason not in _STARTING:
                (stuck if reason in _STUCK_WAITING else slow).append(_said(reason, waiting.get("message")))
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                message = condition.get("message") or ""
                said = _said(condition.get("reason") or "Unschedulable", message)
                selector = (pod.get("spec") or {}).get("nodeSelector") or {}
                if _no_node_matches(message):
                    stuck.append(said)
                elif selector and _taints_may_hide_a_mismatch(message) and not node_labelled(selector):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
                    stuck.append(f"{said} (no node is labelled {labels})")
                else:
                    slow.append(said)
    if not pods:
        refusal = _latest_failed_create(events)
        if refusal is not None:
            (stuck if _refusal_is_final(refusal) else slow).append(_said("FailedCreate", refusal))
    if stuck:
        return StartVerdict(stuck=True, why="; ".join(dict.fromkeys(stuck)))
    if not slow:
        slow.append("no pod of the Job started" if not pods else
                    f"pod {pods[0]['metadata']['name']} is {(pods[0].get('status') or {}).get('phase')}")
    return StartVerdict(stuck=False, why="; ".join(dict.fromkeys(slow)))


def _said(reason: str, message: str | None) -> str:
    return f"{reason}: {message}" if message else reason


def _no_node_matches(message: str) -> bool:
    """True when the scheduler excluded every node for a selector or affinity mismatch, e.g.
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. preemption: ...".
    Any other reason on any node (capacity, a taint, a cordon, no nodes at all) may clear."""
    reasons = _per_node_reasons(message)
    return bool(reasons) and all(_mismatch(r) for r in reasons)


def _taints_may_hide_a_mismatch(message: str) -> bool:
    """Some nodes excluded for a mismatch, every other one for a taint: the scheduler names only the
    first filter a node fails, so a tainted node may mismatch too (a control plane's, usually).
    Whether any node has the labels then decides; an empty cluster, or one where a node is only
    full or cordoned, stays slow (an autoscaler may add a node)."""
    reasons = _per_node_reasons(message)
    return any(_mismatch(r) for r in reasons) and all(_mismatch(r) or "taint" in r for r in reasons)


def _per_node_reasons(message: str) -> list[str]:
    verdict = message.split("preemption:")[0]
    _, _, per_node = verdict.partition("nodes are available:")
    return [r.strip() for r in per_node.strip().rstrip(".").split(",") if r.strip()]


def _mismatch(reason: str) -> bool:
    return any(m in reason for m in _NODE_MISMATCH)


def _latest_failed_create(events: list[dict[str, Any]]) -> str | None:
    for ev in sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "", reverse=True):
        if ev.get("reason") == "FailedCreate":
            return ev.get("message") or ""
    return None


def _refusal_is_final(message: str) -> bool:
    """A pod refused by a quota whose limit is below what the pod alone requests can never be
    created; one refused because the quota is used up now (a throttle) can, once pods end. A
    policy refusal (PodSecurity, LimitRange, a webhook's denial) is final; an unreachable
    webhook or a busy API server is not."""
    if "exceeded quota" not in message:
        return "is forbidden" in message or "denied the request" in message
    match = _QUOTA.search(message)
    if match is None:
        return False
    requested, limited = _amounts(match["requested"]), _amounts(match["limited"])
    return any(name in limited and _quantity(amount) > _quantity(limited[name]) for name, amount in requested.items())


def _amounts(text: str) -> dict[str, str]:
    return dict(part.strip().split("=", 1) for part in text.split(",") if "=" in part)


_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _quantity(text: str) -> float:
    """A Kubernetes quantity ("1", "500m", "2Gi") as a number."""
    number = re.match(r"[0-9.]+", text.strip())
    if number is None:
        return 0.0
    return float(number[0]) * _SUFFIXES.get(text.strip()[number.end():], 1.0)
