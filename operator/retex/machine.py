"""The state machine of tasks and steps, and the retry backoff policy. Pure: no I/O.

Every phase change the ledger makes goes through `task_transition`/`step_transition`, so the
legal moves live in exactly one table. Terminal phases are not re-entrant: the only way out of
Failed or NeedsAttention is an explicit requeue, which is a transition of its own.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class TaskPhase(enum.StrEnum):
    PENDING = "Pending"  # admitted, not yet placed (transient)
    SCHEDULED = "Scheduled"  # waiting for notBefore
    QUEUED = "Queued"  # waiting for capacity or its concurrency key
    RUNNING = "Running"  # an attempt (epoch) is dispatched or executing
    RETRYING = "Retrying"  # the last attempt failed retryably; waiting out the backoff
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    NEEDS_ATTENTION = "NeedsAttention"  # an ambiguous step needs a human decision


class StepState(enum.StrEnum):
    PENDING = "pending"
    STARTED = "started"  # begun by some attempt; its outcome is unknown until committed
    DONE = "done"
    FAILED = "failed"
    NEEDS_ATTENTION = "needs-attention"


TERMINAL_PHASES = frozenset({TaskPhase.SUCCEEDED, TaskPhase.FAILED, TaskPhase.CANCELLED})
# Phases with no attempt running that wait for the operator to act (time, capacity, a human).
WAITING_PHASES = frozenset({TaskPhase.PENDING, TaskPhase.SCHEDULED, TaskPhase.QUEUED, TaskPhase.RETRYING})


class TaskEvent(enum.StrEnum):
    SCHEDULE = "schedule"  # notBefore lies in the future
    ENQUEUE = "enqueue"  # runnable, but no capacity or its concurrency key is busy
    START_ATTEMPT = "start-attempt"  # a new epoch is dispatched
    REPLACE_ATTEMPT = "replace-attempt"  # the running epoch was lost (lease, disruption): epoch + 1
    RETRY = "retry"  # the attempt failed retryably; back off
    SUCCEED = "succeed"
    FAIL = "fail"  # permanent error, budget exhausted, timeout
    NEED_ATTENTION = "need-attention"  # an ambiguous step with no safe automatic resolution
    CANCEL = "cancel"
    REQUEUE = "requeue"  # a human gives a failed or flagged task a fresh budget


class StepEvent(enum.StrEnum):
    BEGIN = "begin"
    COMMIT = "commit"
    FAIL = "fail"
    FLAG = "flag"  # started, outcome unknown, not safe to re-run
    RESOLVE_DONE = "resolve-done"  # a human says the effect happened
    RESOLVE_RERUN = "resolve-rerun"  # a human says it did not: run it again


class IllegalTransition(Exception):
    """A state change the machine does not allow (for example leaving a terminal phase)."""

    def __init__(self, kind: str, state: str, event: str):
        super().__init__(f"illegal {kind} transition: {event!r} from {state!r}")
        self.state, self.event = state, event


P, E = TaskPhase, TaskEvent
_NOT_TERMINAL = [p for p in TaskPhase if p not in TERMINAL_PHASES]

TASK_TRANSITIONS: dict[tuple[TaskPhase, TaskEvent], TaskPhase] = {
    (P.PENDING, E.SCHEDULE): P.SCHEDULED,
    **{(p, E.ENQUEUE): P.QUEUED for p in (P.PENDING, P.SCHEDULED, P.RETRYING)},
    **{(p, E.START_ATTEMPT): P.RUNNING for p in (P.PENDING, P.SCHEDULED, P.QUEUED, P.RETRYING)},
    (P.RUNNING, E.REPLACE_ATTEMPT): P.RUNNING,
    (P.RUNNING, E.RETRY): P.RETRYING,
    (P.RUNNING, E.SUCCEED): P.SUCCEEDED,
    **{(p, E.FAIL): P.FAILED for p in _NOT_TERMINAL},
    (P.RUNNING, E.NEED_ATTENTION): P.NEEDS_ATTENTION,
    **{(p, E.CANCEL): P.CANCELLED for p in _NOT_TERMINAL},
    **{(p, E.REQUEUE): P.PENDING for p in (P.FAILED, P.NEEDS_ATTENTION)},
}

S, SE = StepState, StepEvent
STEP_TRANSITIONS: dict[tuple[StepState, StepEvent], StepState] = {
    # A step begun again by a later attempt stays `started`: the idempotent re-run of R6.
    **{(s, SE.BEGIN): S.STARTED for s in (S.PENDING, S.STARTED, S.FAILED)},
    (S.STARTED, SE.COMMIT): S.DONE,
    (S.STARTED, SE.FAIL): S.FAILED,
    (S.STARTED, SE.FLAG): S.NEEDS_ATTENTION,
    (S.NEEDS_ATTENTION, SE.RESOLVE_DONE): S.DONE,
    (S.NEEDS_ATTENTION, SE.RESOLVE_RERUN): S.PENDING,
}
del P, E, S, SE


def task_transition(phase: TaskPhase | str, event: TaskEvent | str) -> TaskPhase:
    try:
        return TASK_TRANSITIONS[(TaskPhase(phase), TaskEvent(event))]
    except KeyError:
        raise IllegalTransition("task", str(phase), str(event)) from None


def step_transition(state: StepState | str, event: StepEvent | str) -> StepState:
    try:
        return STEP_TRANSITIONS[(StepState(state), StepEvent(event))]
    except KeyError:
        raise IllegalTransition("step", str(state), str(event)) from None


def completed_prefix(states: list[StepState | str]) -> int:
    """How many leading steps are done: where a resumed task continues, whatever was written last."""
    count = 0
    for state in states:
        if state != StepState.DONE:
            break
        count += 1
    return count


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff, capped, with optional full jitter (AWS architecture blog's "full jitter")."""

    initial_seconds: float = 1.0
    max_seconds: float = 300.0
    factor: float = 2.0
    full_jitter: bool = True

    def ceiling(self, retry_number: int) -> float:
        """The un-jittered delay before retry `retry_number` (1 = the first retry)."""
        if retry_number < 1:
            raise ValueError("retry_number starts at 1")
        # min() before the power would overflow for large retry numbers.
        exponent = min(retry_number - 1, 1024)
        try:
            raw = self.initial_seconds * self.factor**exponent
        except OverflowError:
            raw = self.max_seconds
        return min(self.max_seconds, raw)

    def delay(self, retry_number: int, rng: random.Random | None = None) -> float:
        ceiling = self.ceiling(retry_number)
        if not self.full_jitter:
            return ceiling
        return (rng or random).uniform(0.0, ceiling)
