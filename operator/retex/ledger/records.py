"""What the ledger hands out: immutable snapshots of committed state."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from retex.machine import TERMINAL_PHASES, Backoff, StepState, TaskPhase, completed_prefix

RESULT_LIMIT_BYTES = 65536  # also a CHECK on retex.steps.result


@dataclass(frozen=True)
class TaskAdmission:
    """Everything the ledger needs to admit a Task; built by the operator from the Task spec."""

    uid: str
    namespace: str
    name: str
    spec: dict[str, Any]
    step_names: list[str]
    max_attempts: int = 3
    max_disruptions: int = 10
    backoff: Backoff = field(default_factory=Backoff)
    idempotency_key: str | None = None
    not_before: datetime | None = None
    concurrency_key: str | None = None
    priority: int = 0
    timeout_seconds: int | None = None
    submitted_at: datetime | None = None  # the Task's creationTimestamp: FIFO order


@dataclass(frozen=True)
class TaskRef:
    """A task by uid and name; perhaps purged (then only its tombstone knows it)."""

    uid: str
    namespace: str
    name: str


@dataclass(frozen=True)
class Refusal:
    """Why the operator did not admit a Task; final for its uid (the first one stored stands)."""

    uid: str
    namespace: str
    name: str
    reason: str  # InvalidSpec, AnnotationsTooLarge, JobRejected, DuplicateIdempotencyKey, QuotaExceeded, ...
    message: str
    generation: int | None  # metadata.generation it was decided on


@dataclass(frozen=True)
class NamespaceQuota:
    """What one namespace may keep in the ledger, judged when a task is admitted."""

    max_tasks: int  # tasks not yet purged, whatever their phase
    max_result_bytes: int  # bytes of their steps' results, as stored


@dataclass(frozen=True)
class NamespaceUsage:
    """What a namespace keeps in the ledger now (retex.namespace_usage)."""

    tasks: int
    result_bytes: int


@dataclass(frozen=True)
class QuotaUse:
    """The quota a namespace is at or over: what it uses (without the task refused) and its limit."""

    namespace: str
    resource: str  # tasks or resultBytes
    used: int
    limit: int


@dataclass(frozen=True)
class AdmitResult:
    uid: str  # the task that holds this work (the first one, for an idempotency-key duplicate)
    created: bool
    duplicate_of: TaskRef | None = None  # the task (live or purged) that used the idempotencyKey first
    purged: bool = False  # the task ended and its history was purged: it is not admitted again
    refusal: Refusal | None = None  # it was refused before: never admitted
    over_quota: QuotaUse | None = None  # its namespace keeps as much as its quota allows: not admitted


@dataclass(frozen=True)
class StepRecord:
    idx: int
    name: str
    state: StepState
    attempt: int | None
    idempotency_key: str
    result: Any
    error: str | None
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True)
class TaskRecord:
    uid: str
    namespace: str
    name: str
    spec: dict[str, Any]
    spec_hash: str
    phase: TaskPhase
    reason: str | None
    dead_lettered: bool
    epoch: int
    failures: int
    disruptions: int
    max_attempts: int
    max_disruptions: int
    not_before: datetime | None
    concurrency_key: str | None
    priority: int
    deadline_at: datetime | None
    cancel_requested: bool
    last_error: str | None
    version: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    steps: tuple[StepRecord, ...]
    frozen_reason: str | None = None  # LedgerBehind or LedgerLost (retex.ledger.witness)
    witness: dict[str, Any] | None = None  # the Task's status when it was frozen

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def completed_steps(self) -> int:
        return completed_prefix([s.state for s in self.steps])


@dataclass(frozen=True)
class AttemptRecord:
    epoch: int
    cause: str
    job_name: str | None
    pod: str | None
    node: str | None
    outcome: str | None
    started_at: datetime
    ended_at: datetime | None


@dataclass(frozen=True)
class WatchedAttempt:
    """An attempt the reaper watches: the current one of a Running task (`current`), or one the
    operator ended that may still be running a step (it holds its slot and key until settled)."""

    uid: str
    namespace: str
    name: str
    epoch: int
    current: bool
    cancel_requested: bool
    job_name: str | None
    dispatched_seconds_ago: float | None  # since its Job was created (database clock); None: not yet


@dataclass(frozen=True)
class HistoryEntry:
    at: datetime
    actor: str
    event: str
    epoch: int | None
    step_idx: int | None
    from_state: str | None
    to_state: str | None
    detail: dict[str, Any] | None


@dataclass(frozen=True)
class Dispatch:
    """An outbox record to relay: create the Job for (task, epoch)."""

    id: int
    task_uid: str
    epoch: int
    namespace: str
    name: str
    spec: dict[str, Any]
    deadline_at: datetime | None = None  # the task's timeout, if any: the Job gets the time left
    deferred_seconds: float | None = None  # since its first deferral (database clock); None: never deferred
    cancel_reason: str | None = None  # cancel requested: what the task ends with (Cancelled, TaskDeleted)


@dataclass(frozen=True)
class Histogram:
    count: int
    total: float  # sum of the observations, seconds
    cumulative: list[int]  # observations <= each bucket bound, in the bounds' order


# Upper bounds of the duration histograms, 10 ms to 6 h: P50/P95/P99 of a step or a task stay
# meaningful from quick calls to long pipelines. The ledger keeps what a purge took per bound.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200,
                    21600)


@dataclass(frozen=True)
class LedgerFigures:
    """What the operator exports. `tasks_by_phase`, `dead_lettered`, `outbox_lag_seconds` and
    `deadline_overrun_seconds` are the state now; the rest are counts since the ledger began,
    derived from append-only rows (history, attempts) plus what history-retention purges took
    (retex.purged_tallies), so they never decrease: a requeue or a retry adds to them, a purge
    takes nothing away."""

    tasks_by_phase: dict[str, int]
    dead_lettered: int  # tasks dead-lettered now (a requeue clears it)
    frozen: int  # tasks frozen now: their Task showed more than the ledger holds (retex.ledger.witness)
    outbox_lag_seconds: float  # age of the oldest unsent dispatch record
    deadline_overrun_seconds: float  # how far the unfinished task furthest past its deadline is past it
    submitted: int  # tasks admitted
    finished_by_phase: dict[str, int]  # times a task reached Succeeded / Failed / Cancelled
    dead_lettered_ever: int  # times a task was dead-lettered
    attempts_by_cause: dict[str, int]
    step_seconds: Histogram  # begin → commit or failure, per step run that ended
    task_seconds: Histogram  # submission → terminal, each time a task reached one
    first_step_seconds: Histogram  # submission → first step began
