"""Task.status as a pure function of the ledger: what a Task shows (`compute_status`), how it is
written (`as_merge_patch`: unset fields deleted), the Events a change makes (`events_between`), and
the order a backlog is written in (`in_fair_order`). The loops that write them are
retex.operator.mirror (the status, the dead-letter label) and retex.operator.events (the Events).
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from retex.api import ConditionType, LeaseStatus, ShownPhase, StepStatus, TaskStatus, find_condition, set_condition
from retex.kube.leasewatch import LeaseObservation
from retex.ledger import TaskRecord
from retex.machine import TaskPhase

# `kubectl get tasks.retex.dev -l retex.dev/dead-letter=true` lists the dead letters.
DEAD_LETTER_LABEL = "retex.dev/dead-letter"

# (phase) -> (Event reason, warning?) posted when a task enters the phase.
_PHASE_EVENTS = {
    ShownPhase.SCHEDULED: ("Scheduled", False),
    ShownPhase.QUEUED: ("Queued", False),
    ShownPhase.RETRYING: ("Retrying", True),
    ShownPhase.SUCCEEDED: ("Succeeded", False),
    ShownPhase.FAILED: ("Failed", True),
    ShownPhase.CANCELLED: ("Cancelled", False),
    ShownPhase.NEEDS_ATTENTION: ("NeedsAttention", True),
    ShownPhase.LEDGER_BEHIND: ("LedgerBehind", True),
}
# Posted whatever the Event limiter says: the Event of a task's end, or of its wait for a human,
# must not be crowded out by the AttemptStarted catch-up before it. A task enters these phases a
# bounded number of times (once more only after a human action), so they cannot flood anything.
FINAL_EVENTS = frozenset(_PHASE_EVENTS[phase][0] for phase in (
    ShownPhase.SUCCEEDED, ShownPhase.FAILED, ShownPhase.CANCELLED, ShownPhase.NEEDS_ATTENTION, ShownPhase.LEDGER_BEHIND))


def _summary(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def compute_status(record: TaskRecord, *, lease: LeaseObservation | None, generation: int | None,
                   previous: TaskStatus | None, now: datetime) -> TaskStatus:
    """Task.status for `record`. Pure: the same inputs give the same status."""
    phase = record.phase
    conditions = previous.conditions if previous else None

    def put(kind: ConditionType, true: bool, reason: str, message: str = "") -> None:
        nonlocal conditions
        conditions = set_condition(conditions, kind, "True" if true else "False", reason, message,
                                   observed_generation=generation, now=now)

    why = record.reason or str(phase)
    error = record.last_error or ""
    put(ConditionType.ACCEPTED, True, "Admitted", "recorded in the ledger")
    put(ConditionType.RUNNING, phase == TaskPhase.RUNNING,
        "AttemptRunning" if phase == TaskPhase.RUNNING else str(phase),
        f"attempt {record.epoch}" if phase == TaskPhase.RUNNING else "")
    put(ConditionType.SUCCEEDED, phase == TaskPhase.SUCCEEDED, why if phase == TaskPhase.SUCCEEDED else "NotSucceeded")
    put(ConditionType.FAILED, phase == TaskPhase.FAILED, why if phase == TaskPhase.FAILED else "NotFailed",
        error if phase == TaskPhase.FAILED else "")
    put(ConditionType.DEAD_LETTERED, record.dead_lettered, why if record.dead_lettered else "NotDeadLettered",
        error if record.dead_lettered else "")
    put(ConditionType.NEEDS_ATTENTION, phase == TaskPhase.NEEDS_ATTENTION,
        why if phase == TaskPhase.NEEDS_ATTENTION else "NoAmbiguousStep",
        error if phase == TaskPhase.NEEDS_ATTENTION else "")
    # One condition for every ending, so `kubectl wait --for=condition=Completed` returns whatever
    # the outcome. NeedsAttention is not an ending: a human's resolve lets the task run on.
    put(ConditionType.COMPLETED, record.terminal, str(phase),
        (f"{why}: {error}" if error else why) if record.terminal else "")

    lease_status = None
    if lease is not None and lease.holder_pod is not None and phase == TaskPhase.RUNNING:
        lease_status = LeaseStatus(holder=f"{lease.holder_pod}:{lease.holder_epoch}",
                                   renewed_at=datetime.fromtimestamp(lease.changed_wall, UTC),
                                   duration_seconds=lease.duration_seconds)
    return TaskStatus(
        phase=ShownPhase(phase),
        attempt=record.epoch,
        completed_steps=record.completed_steps,
        total_steps=len(record.steps),
        steps=[
            StepStatus(name=s.name, state=s.state, attempt=s.attempt, started_at=s.started_at,
                       finished_at=s.finished_at, result=_summary(s.result), error=s.error)
            for s in record.steps
        ],
        lease=lease_status,
        retries=record.failures,
        disruptions=record.disruptions,
        conditions=conditions,
        ledger_version=record.version,
        observed_generation=generation,
        start_time=record.started_at,
        completion_time=record.finished_at if record.terminal else None,
        last_error=record.last_error,
    )


def as_merge_patch(status: TaskStatus) -> dict[str, Any]:
    """The whole status as a merge patch: a field that is now unset is sent as null, which
    deletes it (a merge patch keeps what it does not mention: a finished task would go on showing
    its last lease holder)."""
    patch = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    unset = {name for name, value in status.model_dump(by_alias=True).items() if value is None}
    return {**patch, **dict.fromkeys(unset)}


def events_between(previous: TaskStatus | None, current: TaskStatus) -> list[tuple[str, str, bool]]:
    """(reason, message, warning) for what changed between the shown and the new status."""
    events = []
    if previous is None or previous.phase is None:
        events.append(("Accepted", "recorded in the ledger", False))
    # Every attempt started since the shown status, also one that ended before the mirror saw it
    # Running (a short task can go from Queued to Succeeded between two writes).
    old_attempt = (previous.attempt or 0) if previous else 0
    for attempt in range(old_attempt + 1, (current.attempt or 0) + 1):
        events.append(("AttemptStarted", f"attempt {attempt} dispatched", False))
    if previous is None or previous.phase != current.phase:
        if current.phase in _PHASE_EVENTS:
            reason, warning = _PHASE_EVENTS[current.phase]
            frozen = find_condition(current.conditions, ConditionType.LEDGER_BEHIND)
            why = frozen.message if current.phase == ShownPhase.LEDGER_BEHIND and frozen else current.last_error
            events.append((reason, why or f"task {current.phase}", warning))
    return events


def labelled_dead(task: dict[str, Any]) -> bool:
    return (task["metadata"].get("labels") or {}).get(DEAD_LETTER_LABEL) == "true"


def in_fair_order(uids: list[str], phases: dict[str, tuple[str, TaskPhase]],
                  marked_at: dict[str, float]) -> list[str]:
    """The order a backlog of marked tasks is written in. Tasks doing something first, a task
    waiting for its notBefore (Scheduled) last: its status says only that it waits. Within each,
    the namespaces take turns, one task each, the oldest mark first: a namespace with thousands of
    marks holds up another's status by a write a round, not by its whole backlog. `phases`: uid →
    (namespace, phase) as the ledger holds it; the tasks it does not hold take turns as one namespace."""

    def waits(uid: str) -> bool:
        return uid in phases and phases[uid][1] == TaskPhase.SCHEDULED

    by_mark = sorted(uids, key=lambda uid: (waits(uid), marked_at.get(uid, 0.0)))
    turn: dict[str, int] = {}
    taken: Counter[tuple[bool, str | None]] = Counter()
    for uid in by_mark:  # each task's turn: how many of its namespace's come before it
        namespace = (waits(uid), phases[uid][0] if uid in phases else None)
        turn[uid] = taken[namespace]
        taken[namespace] += 1
    return sorted(by_mark, key=lambda uid: (waits(uid), turn[uid]))  # stable: by mark within a turn

