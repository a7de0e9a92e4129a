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
