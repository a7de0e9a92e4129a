"""The Task is the ledger's witness: what the operator does when a Task's status shows more of a
task than the ledger holds — the ledger was restored from a backup, failed over to a replica that
lost commits, or is a fresh database. Running from what the ledger forgot would repeat effects
that were already paid for, so the task is frozen: no worker may step on it (`moves.fence`), its
unsent dispatches are held (`outbox.not_before` = infinity; a Job a relay was already creating
meets the fence), no slot is filled with it and it keeps its concurrency key, the promoter and the
reaper leave it as it is, until a human recovers it — from what its status showed, or afresh.
And which install owns the ledger, so a second install pointed at it refuses to start instead of
fighting over the leadership term.

Each operation takes a cursor of the caller's transaction (`Ledger` runs it in one of its own)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from psycopg.types.json import Jsonb

from retex.ledger import readers
from retex.ledger.errors import InstallMismatch, NotFrozen
from retex.ledger.moves import end_attempt, lock_task, record_history
from retex.ledger.operator_operations import NotAdmitted, insert_task
from retex.ledger.placement import place
from retex.ledger.records import TaskAdmission, TaskRecord
from retex.ledger.rows import Cursor, TaskRow
from retex.machine import TERMINAL_PHASES, StepState, TaskPhase

LEDGER_BEHIND = "LedgerBehind"  # the ledger holds the task at a version below the one its status showed
LEDGER_LOST = "LedgerLost"  # the ledger did not hold the task at all
FROZEN_REASONS = (LEDGER_BEHIND, LEDGER_LOST)


def freeze(cur: Cursor, uid: str, *, reason: str, witness: dict[str, Any], shown_version: int,
           actor: str) -> TaskRecord:
    """Freeze a task its Task showed at `shown_version`, above the ledger's version: its unsent
    dispatches are held, and its version jumps past the one shown, so the status mirror can
    write the frozen status (the API server refuses a lower ledgerVersion). Already frozen, or
    the ledger at or past `shown_version` under the row's lock (a status read before a commit
    that a worker made meanwhile is no evidence of loss): as it was."""
    task = lock_task(cur, uid)
    if task.frozen_reason is None and shown_version > task.version:
        _freeze(cur, task, reason=reason, witness=witness, shown_version=shown_version, actor=actor)
    return readers.get(cur, uid)


def admit_lost(cur: Cursor, admission: TaskAdmission, *, witness: dict[str, Any], shown_version: int,
               actor: str) -> TaskRecord | None:
    """A Task whose status shows it was admitted, which the ledger does not hold: into the ledger
    frozen (LedgerLost), Pending, with no attempt. A final decision that stands for its uid
    (refused, purged) is raised as `NotAdmitted` by `insert_task`, the caller's to judge. Its
    idempotencyKey taken by another task meanwhile (a Task resubmitted while the ledger was away)
    leaves it frozen without the key: the Task showed it admitted, so it is no duplicate to refuse."""
    try:
        with cur.connection.transaction():  # a savepoint: a refusal leaves nothing of the insert
            inserted = insert_task(cur, admission, actor=actor)
    except NotAdmitted as not_admitted:
        if not_admitted.verdict.duplicate_of is None:
            raise
        inserted = insert_task(cur, replace(admission, idempotency_key=None), actor=actor)
    if inserted is None:  # admitted meanwhile (another leader's handler): judged as held
        return readers.get(cur, admission.uid)
    _freeze(cur, inserted, reason=LEDGER_LOST, witness=witness, shown_version=shown_version, actor=actor)
    return readers.get(cur, admission.uid)


def _freeze(cur: Cursor, task: TaskRow, *, reason: str, witness: dict[str, Any], shown_version: int,
            actor: str) -> None:
    if reason not in FROZEN_REASONS:
        raise ValueError(f"freeze reason {reason!r} is not one of {', '.join(FROZEN_REASONS)}")
    cur.execute("UPDATE retex.tasks SET frozen_reason = %s, witness = %s, version = greatest(version, %s) + 1, "
                "updated_at = now() WHERE uid = %s", (reason, Jsonb(witness), shown_version, task.uid))
    cur.execute("UPDATE retex.outbox SET not_before = 'infinity' WHERE task_uid = %s AND sent_at IS NULL", (task.uid,))
    record_history(cur, task.uid, actor, "freeze", epoch=task.epoch, from_state=task.phase, to_state=task.phase,
                   detail={"reason": reason, "shownVersion": shown_version, "ledgerVersion": task.version})


def recover(cur: Cursor, uid: str, *, from_status: bool, actor: str, min_epoch: int = 0) -> TaskRecord:
    """A human's decision for a frozen task. `from_status`: its steps are rebuilt from what its
    Task showed (done steps stay done with the result summary shown; a step shown started stays
    of unknown outcome, verified or flagged by the next attempt, as after any crash), and a task
    shown ended (or waiting for a human) stays so. Otherwise (afresh) the ledger's own steps
    stand: a step it does not record as done runs again. Either way a task left to run starts a
    new attempt, its epoch past `min_epoch` and any the Task showed (Jobs of epochs the ledger
    forgot may exist), and its timeout counted afresh from that attempt."""
    task = lock_task(cur, uid)
    if task.frozen_reason is None:
        raise NotFrozen(f"task {uid} is not frozen: there is nothing to recover")
    witness = task.witness or {}
    shown = Shown.of(witness)
    if from_status:
        _steps_from_status(cur, uid, witness.get("steps") or [])
    if task.phase == TaskPhase.RUNNING:  # its worker was fenced: the attempt ends, a new one starts
        end_attempt(cur, uid, task.epoch, "superseded", settled=False)
    cur.execute("UPDATE retex.outbox SET sent_at = now(), outcome = 'stale' WHERE task_uid = %s AND sent_at IS NULL",
                (uid,))
    if from_status and shown.stays:
        phase, reason = shown.phase, shown.reason
    elif task.phase in TERMINAL_PHASES:
        phase, reason = TaskPhase(task.phase), task.reason  # the ledger says it ended: a requeue runs it again
    else:
        phase, reason = TaskPhase.PENDING, None
    cur.execute(
        """UPDATE retex.tasks SET frozen_reason = NULL, phase = %s, reason = %s, epoch = greatest(epoch, %s, %s),
                  failures = greatest(failures, %s), disruptions = greatest(disruptions, %s),
                  dead_lettered = dead_lettered OR %s,
                  finished_at = CASE WHEN %s THEN coalesce(finished_at, now()) END,
                  deadline_at = CASE WHEN %s THEN NULL ELSE deadline_at END,
                  version = version + 1, updated_at = now()
           WHERE uid = %s""",
        (str(phase), reason, shown.attempt, min_epoch, shown.retries if from_status else 0,
         shown.disruptions if from_status else 0, from_status and shown.dead_lettered, phase in TERMINAL_PHASES,
         phase == TaskPhase.PENDING, uid))
    recovered = lock_task(cur, uid)
    record_history(cur, uid, actor, "recover", epoch=recovered.epoch, from_state=task.phase, to_state=phase,
                   detail={"mode": "from-status" if from_status else "afresh", "frozen": task.frozen_reason,
                           "shownPhase": shown.phase, "shownAttempt": shown.attempt})
    if phase == TaskPhase.PENDING:
        place(cur, recovered, "requeue", actor)
    return readers.get(cur, uid)


@dataclass(frozen=True)
class Shown:
    """What a Task's status showed of its task, read from the status a freeze kept."""

    phase: TaskPhase | None
    reason: str | None
    attempt: int
    retries: int
    disruptions: int
    dead_lettered: bool

    @property
    def stays(self) -> bool:
        """Shown ended, or waiting for a human's decision: a recovery from status keeps it so."""
        return self.phase in TERMINAL_PHASES or self.phase == TaskPhase.NEEDS_ATTENTION

    @classmethod
    def of(cls, status: dict[str, Any]) -> Shown:
        """A status whose phase is not the ledger's own (LedgerBehind: a frozen task's, found again
        after a second restore) is read from its conditions, which keep the task's own."""
        conditions = {c.get("type"): c for c in status.get("conditions") or []}

        def holds(kind: str) -> bool:
            return (conditions.get(kind) or {}).get("status") == "True"

        phase = _phase(status.get("phase"))
        if phase is None and holds("Completed"):
            phase = _phase(conditions["Completed"].get("reason"))
        if phase is None and holds("NeedsAttention"):
            phase = TaskPhase.NEEDS_ATTENTION
        reason = None
        if phase in (TaskPhase.SUCCEEDED, TaskPhase.FAILED, TaskPhase.NEEDS_ATTENTION):
            reason = (conditions.get(str(phase)) or {}).get("reason")
        elif phase == TaskPhase.CANCELLED:
            reason = str((conditions.get("Completed") or {}).get("message") or "Cancelled").split(":")[0]
        return cls(phase=phase, reason=reason, attempt=int(status.get("attempt") or 0),
                   retries=int(status.get("retries") or 0), disruptions=int(status.get("disruptions") or 0),
                   dead_lettered=holds("DeadLettered"))


def _phase(value: Any) -> TaskPhase | None:
    return TaskPhase(value) if value in set(TaskPhase) else None


def _steps_from_status(cur: Cursor, uid: str, shown_steps: list[dict[str, Any]]) -> None:
    """Each step as the Task's status showed it. A done step's result is the summary shown: the
    value itself when the summary is whole JSON, else the summary's text (the status holds a
    truncated summary; the full result was in the ledger that was lost)."""
    for shown in shown_steps:
        state = StepState(shown.get("state", StepState.PENDING))
        if state == StepState.PENDING:
            continue  # nothing known beyond what the ledger holds
        cur.execute(
            """UPDATE retex.steps SET state = %s, attempt = coalesce(%s, attempt), result = %s, error = %s,
                      started_at = coalesce(%s, started_at), finished_at = %s
               WHERE task_uid = %s AND name = %s""",
            (str(state), shown.get("attempt"), Jsonb(_shown_result(shown.get("result"))) if state == StepState.DONE else None,
             shown.get("error"), shown.get("startedAt"), shown.get("finishedAt"), uid, shown.get("name")))


def _shown_result(summary: str | None) -> Any:
    if summary is None:
        return None
    try:
        return json.loads(summary)
    except ValueError:
        return summary


def claim_install(cur: Cursor, *, uid: str, namespace: str, adopt_from: str | None) -> None:
    """Record this install as the ledger's owner on its first start; refuse another's
    (`InstallMismatch`), unless `adopt_from` names the owner this install replaces."""
    cur.execute("INSERT INTO retex.install (uid, namespace) VALUES (%s, %s) ON CONFLICT DO NOTHING", (uid, namespace))
    owner_uid, owner_namespace = cur.execute("SELECT uid, namespace FROM retex.install FOR UPDATE").fetchone() or ("", "")
    if owner_uid == uid:
        return
    if adopt_from is not None and adopt_from == owner_uid:
        cur.execute("UPDATE retex.install SET uid = %s, namespace = %s, claimed_at = now()", (uid, namespace))
        return
    raise InstallMismatch(owner_uid, owner_namespace, uid, namespace)
