"""The control plane's operations: admission and refusals (the operator's handlers), attempts
ended, replaced or settled (the reaper), due tasks and deadlines (the promoter), the human
actions (the handlers for a Kubernetes user, the CLI for an administrator), and history
retention. Each takes a cursor of the caller's transaction (`Ledger` runs it in one of its own)
and is idempotent when repeated, except where its docstring says how a repeat is told apart."""

from __future__ import annotations

import random
from dataclasses import asdict
from typing import Any

from psycopg.types.json import Jsonb

from retex.ledger import readers
from retex.ledger.errors import StepInFlight, StepNotFound
from retex.ledger.hashing import spec_hash, step_idempotency_key
from retex.ledger.moves import (
    NOW,
    cancel_reason,
    check_result_size,
    end_attempt,
    lock_task,
    lock_task_if_any,
    move_step,
    record_history,
    touch,
)
from retex.ledger.placement import fill_slots, place, retry_or_fail, start_attempt, transition
from retex.ledger.records import AdmitResult, NamespaceQuota, QuotaUse, Refusal, TaskAdmission, TaskRecord
from retex.ledger.rows import Cursor, TaskRow, column_list, fetch_all, fetch_one, one, scalar
from retex.machine import TERMINAL_PHASES, IllegalTransition, StepEvent, StepState, TaskEvent, TaskPhase

CANCEL_REASONS = ("Cancelled", "TaskDeleted")


# -- admission (the handlers) ---------------------------------------------------------------

class NotAdmitted(Exception):
    """Raised by `admit` when the task must not be admitted: rolls the transaction back, and
    `Ledger.admit` returns its verdict."""

    def __init__(self, verdict: AdmitResult):
        super().__init__(verdict)
        self.verdict = verdict


def admit(cur: Cursor, admission: TaskAdmission, *, actor: str, quota: NamespaceQuota | None = None) -> AdmitResult:
    """Insert the task and its steps, then schedule it or start attempt 1 with its dispatch.
    Raises NotAdmitted when its namespace is at or over its `quota` (nothing written)."""
    inserted = insert_task(cur, admission, actor=actor)
    if inserted is None:
        return AdmitResult(uid=admission.uid, created=False)  # admitted before
    if quota is not None:
        over = over_quota(cur, admission.namespace, quota)
        if over is not None:
            raise NotAdmitted(AdmitResult(uid=admission.uid, created=False, over_quota=over))
    place(cur, inserted, "first", actor)
    return AdmitResult(uid=admission.uid, created=True)


def over_quota(cur: Cursor, namespace: str, quota: NamespaceQuota) -> QuotaUse | None:
    """The quota a namespace was at or over before the task just inserted, or None. One row: the
    insert's trigger counted the task in retex.namespace_usage and holds that row's lock to the
    end of this transaction, so a concurrent admission in the namespace waits and sees this one."""
    tasks, result_bytes = one(cur.execute(
        "SELECT tasks, result_bytes FROM retex.namespace_usage WHERE namespace = %s", (namespace,)))
    if tasks - 1 >= quota.max_tasks:
        return QuotaUse(namespace=namespace, resource="tasks", used=tasks - 1, limit=quota.max_tasks)
    if result_bytes >= quota.max_result_bytes:
        return QuotaUse(namespace=namespace, resource="resultBytes", used=result_bytes, limit=quota.max_result_bytes)
    return None


def insert_task(cur: Cursor, admission: TaskAdmission, *, actor: str) -> TaskRow | None:
    """The task's row, its steps and its history's first line, Pending (None: it was admitted
    before). Raises NotAdmitted when a final decision stands for it (refused, purged, duplicate)."""
    inserted = fetch_one(
        cur, TaskRow,
        f"""INSERT INTO retex.tasks (uid, namespace, name, spec, spec_hash, idempotency_key, phase,
                                    max_attempts, max_disruptions, backoff, not_before,
                                    concurrency_key, priority, timeout_seconds, submitted_at)
           VALUES (%s, %s, %s, %s, %s, %s, 'Pending', %s, %s, %s, %s, %s, %s, %s, %s)
           ON CONFLICT DO NOTHING RETURNING {column_list(TaskRow)}""",
        (admission.uid, admission.namespace, admission.name, Jsonb(admission.spec),
         spec_hash(admission.spec), admission.idempotency_key, admission.max_attempts,
         admission.max_disruptions, Jsonb(asdict(admission.backoff)), admission.not_before,
         admission.concurrency_key, admission.priority, admission.timeout_seconds,
         admission.submitted_at),
    )
    # Checked after the insert, in its own statement: a purge that committed while the insert
    # waited on the row is seen here (a check before it could miss it).
    verdict = readers.prior_verdict(cur, admission)
    if verdict is not None:
        raise NotAdmitted(verdict)
    if inserted is None:
        return None
    step_specs = admission.spec.get("steps") or [None] * len(admission.step_names)
    for idx, (name, step_spec) in enumerate(zip(admission.step_names, step_specs, strict=True)):
        cur.execute(
            "INSERT INTO retex.steps (task_uid, idx, name, idempotency_key) VALUES (%s, %s, %s, %s)",
            (admission.uid, idx, name, step_idempotency_key(admission.uid, name, step_spec)),
        )
    record_history(cur, admission.uid, actor, "admit", to_state=TaskPhase.PENDING)
    return inserted


def refuse(cur: Cursor, refusal: Refusal) -> Refusal:
    """Record that a Task is not admitted. Final for its uid: the first refusal stored stands
    (and is returned), and `admit` never admits the uid."""
    cur.execute(
        """INSERT INTO retex.refusals (uid, namespace, name, reason, message, generation)
           VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (uid) DO NOTHING""",
        (refusal.uid, refusal.namespace, refusal.name, refusal.reason, refusal.message[:4096],
         refusal.generation),
    )
    stored = readers.refusal(cur, refusal.uid)  # this one, or the one stored before it
    if stored is None:
        raise LookupError(f"no refusal stored for {refusal.uid}")
    return stored


# -- attempts (the reaper) ------------------------------------------------------------------

def replace_attempt(cur: Cursor, uid: str, lost_epoch: int, *, cause: str, actor: str) -> TaskRecord:
    """The attempt `lost_epoch` is gone (lease expired or released, pod disrupted): start the next.

    A disruption does not consume the retry budget; it has its own cap. Repeating the call for
    the same lost epoch changes nothing; so does a frozen task (a person decides what it does next).
    """
    task = lock_task(cur, uid)
    if task.epoch != lost_epoch or task.phase != TaskPhase.RUNNING or task.frozen_reason is not None:
        return readers.get(cur, uid)
    end_attempt(cur, uid, lost_epoch, "lost")
    if task.cancel_requested:
        transition(cur, task, TaskEvent.CANCEL, actor, reason=cancel_reason(task))
    elif task.disruptions + 1 > task.max_disruptions:
        transition(cur, task, TaskEvent.FAIL, actor, reason="DisruptionBudgetExhausted",
                   dead_lettered=True, disruptions=task.disruptions + 1,
                   last_error=f"attempt {lost_epoch} lost ({cause}); disruption cap reached")
    else:
        start_attempt(cur, task, TaskEvent.REPLACE_ATTEMPT, cause, actor,
                      disruptions=task.disruptions + 1)
    return readers.get(cur, uid)


def settle_attempt(cur: Cursor, uid: str, epoch: int, *, actor: str) -> None:
    """Attempt `epoch`, already ended by the operator, is known dead: free its slot and key."""
    settled = cur.execute(
        """UPDATE retex.attempts SET settled_at = now() WHERE task_uid = %s AND epoch = %s
           AND outcome IS NOT NULL AND settled_at IS NULL""", (uid, epoch)).rowcount
    if settled:
        record_history(cur, uid, actor, "attempt-settled", epoch=epoch)
        fill_slots(cur, actor)


def fail_unstarted(cur: Cursor, uid: str, epoch: int, error: str, *, actor: str,
                   rng: random.Random | None) -> TaskRecord:
    """Attempt `epoch` never took its lease in time (its pod could not start: image, config,
    scheduling, quota). A failed attempt, counted against the retry budget like a step failure
    (a broken spec would otherwise loop for ever); a cancel request makes it Cancelled.
    No-op unless `epoch` is current and Running and its worker has not claimed it: a slow
    worker may take the lease and claim the attempt (under this row lock) after the caller
    saw no lease, and may then be inside a step. Nor on a frozen task."""
    task = lock_task(cur, uid)
    if (task.epoch != epoch or task.phase != TaskPhase.RUNNING or task.frozen_reason is not None
            or _claimed(cur, uid, epoch)):
        return readers.get(cur, uid)
    end_attempt(cur, uid, epoch, "failed")  # it never held the lease: no step can run
    failures = task.failures + 1
    if task.cancel_requested:
        transition(cur, task, TaskEvent.CANCEL, actor, reason=cancel_reason(task))
    else:
        retry_or_fail(cur, task, failures, error, retry_reason="WorkerNotStarted", actor=actor, rng=rng)
    return readers.get(cur, uid)


def cancel_unheld(cur: Cursor, uid: str, epoch: int, *, actor: str) -> TaskRecord:
    """A cancel (or delete) was requested and attempt `epoch` holds no lease (never took it, or
    its Lease is gone): no worker will reach a step boundary, so the task ends now with its
    cancel reason. A worker that starts later is fenced at its first write. One that claimed the
    attempt may have begun a step before the cancel and be inside it still (its Lease deleted
    under it): the attempt then keeps its slot and key until the reaper knows it dead
    (`settle_attempt`), as fail_unstarted leaves such an attempt running.
    No-op unless `epoch` is current, Running and cancel was requested (a cancel thaws a frozen task)."""
    task = lock_task(cur, uid)
    if (task.epoch != epoch or task.phase != TaskPhase.RUNNING or not task.cancel_requested
            or task.frozen_reason is not None):
        return readers.get(cur, uid)
    end_attempt(cur, uid, epoch, "cancelled", settled=not _claimed(cur, uid, epoch))
    transition(cur, task, TaskEvent.CANCEL, actor, reason=cancel_reason(task))
    return readers.get(cur, uid)


def _claimed(cur: Cursor, uid: str, epoch: int) -> bool:
    """Whether a worker claimed attempt `epoch` (`claim_attempt`, under the task row lock the
    caller holds): it took the lease, and may have begun a step."""
    pod = scalar(cur.execute("SELECT pod FROM retex.attempts WHERE task_uid = %s AND epoch = %s", (uid, epoch)))
    return pod is not None


# -- due tasks and deadlines (the promoter) -------------------------------------------------

def promote_due(cur: Cursor, *, limit: int, actor: str) -> list[str]:
    """Queue the Scheduled and Retrying tasks whose time has come, fail those past their
    deadline, and fill the free slots. Returns the uids that were due."""
    overdue = fetch_all(
        cur, TaskRow,
        f"""SELECT {column_list(TaskRow)} FROM retex.tasks WHERE deadline_at <= now() AND frozen_reason IS NULL
            AND phase NOT IN ('Succeeded', 'Failed', 'Cancelled') LIMIT %s FOR UPDATE SKIP LOCKED""",
        (limit,),
    )
    for task in overdue:
        if task.phase == TaskPhase.RUNNING:  # its step may still run: keeps slot and key
            end_attempt(cur, task.uid, task.epoch, "failed", settled=False)
        transition(cur, task, TaskEvent.FAIL, actor, reason="Timeout",
                   last_error=f"task timeout of {task.timeout_seconds}s exceeded")
    due = fetch_all(
        cur, TaskRow,
        f"""SELECT {column_list(TaskRow)} FROM retex.tasks WHERE phase IN ('Scheduled', 'Retrying')
            AND not_before <= now() AND frozen_reason IS NULL ORDER BY not_before LIMIT %s FOR UPDATE SKIP LOCKED""",
        (limit,),
    )
    for task in due:
        cause = "retry" if task.phase == TaskPhase.RETRYING else "first"
        transition(cur, task, TaskEvent.ENQUEUE, actor, next_cause=cause)
    if due:
        fill_slots(cur, actor)
    return [task.uid for task in due]


# Tasks a purge takes in one transaction (about 0.1–0.3 ms each with their rows): a batch holds the
# leadership term, and the rows it deletes, for a fraction of a second.
PURGE_BATCH = 500


def purge_finished(cur: Cursor, *, older_than_seconds: float, limit: int) -> int:
    """Delete up to `limit` tasks (with their steps, attempts and history) that ended that long
    ago, the oldest first: a batch of the history-retention purge (`Ledger.purge_finished` goes
    on while a batch is full). Each leaves a tombstone (uid, name, final phase, idempotencyKey)
    that is kept forever, and what its rows counted is added to retex.purged_tallies in the same
    transaction (so the exported counters do not go down); a trigger takes each one off its
    namespace's usage (retex.namespace_usage) as it goes. Returns how many went."""
    # Locked, so a requeue cannot move one of them between its count and its delete.
    uids = [uid for (uid,) in cur.execute(
        """SELECT uid FROM retex.tasks WHERE phase IN ('Succeeded', 'Failed', 'Cancelled')
           AND finished_at < now() - make_interval(secs => %s) ORDER BY finished_at, uid LIMIT %s FOR UPDATE""",
        (older_than_seconds, limit),
    )]
    if not uids:
        return 0
    for (metric, label), value in readers.tallies(cur, uids).items():
        cur.execute(
            """INSERT INTO retex.purged_tallies (metric, label, value) VALUES (%s, %s, %s)
               ON CONFLICT (metric, label) DO UPDATE SET value = retex.purged_tallies.value + EXCLUDED.value""",
            (metric, label, value),
        )
    # The Task object may outlive its row; the tombstone keeps `admit` from running it again,
    # and keeps its idempotencyKey taken.
    cur.execute(
        """WITH gone AS (
               DELETE FROM retex.tasks WHERE uid = ANY(%s)
               RETURNING uid, namespace, name, phase, idempotency_key)
           INSERT INTO retex.tombstones (uid, namespace, name, phase, idempotency_key)
           SELECT uid, namespace, name, phase, idempotency_key FROM gone ON CONFLICT DO NOTHING""",
        (uids,),
    )
    return len(uids)  # each locked above: every one of them went


# -- ending a task, and the human actions ---------------------------------------------------

def request_cancel(cur: Cursor, uid: str, *, reason: str, actor: str) -> TaskRecord:
    """Waiting tasks are cancelled at once; a running one at its worker's next step boundary
    (or by the reaper at once when its attempt holds no lease). `reason` is what the task ends
    with when the operator ends it: Cancelled, or TaskDeleted for a deletion (one of
    CANCEL_REASONS, checked by `Ledger.request_cancel` before its transaction)."""
    task = lock_task(cur, uid)
    if task.frozen_reason is not None:  # cancelling or deleting a frozen task decides it too: nothing more runs
        cur.execute("UPDATE retex.outbox SET not_before = NULL WHERE task_uid = %s AND sent_at IS NULL "
                    "AND not_before = 'infinity'", (uid,))
        touch(cur, uid, frozen_reason=None)
        record_history(cur, uid, actor, "thaw", epoch=task.epoch, detail={"frozen": task.frozen_reason, "for": reason})
        task = lock_task(cur, uid)
    if task.phase in TERMINAL_PHASES or task.cancel_requested:
        return readers.get(cur, uid)
    if task.phase == TaskPhase.RUNNING:
        touch(cur, uid, cancel_requested=True, cancel_reason=reason)
        record_history(cur, uid, actor, "cancel-requested", epoch=task.epoch, detail={"reason": reason})
    else:
        transition(cur, task, TaskEvent.CANCEL, actor, reason=reason, cancel_requested=True,
                   cancel_reason=reason)
    return readers.get(cur, uid)


def fail_task(cur: Cursor, uid: str, *, reason: str, message: str, actor: str) -> TaskRecord:
    """Operator-side terminal failure (for example the task timeout). No-op once terminal."""
    task = lock_task(cur, uid)
    if task.phase not in TERMINAL_PHASES:
        if task.phase == TaskPhase.RUNNING:  # its step may still run: keeps slot and key
            end_attempt(cur, uid, task.epoch, "failed", settled=False)
        transition(cur, task, TaskEvent.FAIL, actor, reason=reason, last_error=message)
    return readers.get(cur, uid)


def abandon(cur: Cursor, uid: str, *, reason: str, actor: str) -> TaskRecord | None:
    """Cancel now, not at a step boundary (the Task object is gone). A worker still running
    is fenced out at its next write. No-op once terminal; None for an unknown task."""
    row = lock_task_if_any(cur, uid)
    if row is None:
        return None
    if row.phase not in TERMINAL_PHASES:
        if row.phase == TaskPhase.RUNNING:  # its step may still run: keeps slot and key
            end_attempt(cur, uid, row.epoch, "cancelled", settled=False)
        transition(cur, row, TaskEvent.CANCEL, actor, reason=reason, cancel_requested=True)
    return readers.get(cur, uid)


def requeue(cur: Cursor, uid: str, *, actor: str) -> TaskRecord:
    """A fresh attempt with a fresh budget for a Failed or NeedsAttention task. Refused when
    repeated: `Ledger.requeue` runs it once (`transactions.once`)."""
    task = lock_task(cur, uid)
    flagged = cur.execute(
        "SELECT name FROM retex.steps WHERE task_uid = %s AND state = 'needs-attention'", (uid,)
    ).fetchall()
    if flagged:
        names = ", ".join(name for (name,) in flagged)
        raise IllegalTransition("task", task.phase, f"requeue before resolving step(s) {names}")
    pending = transition(cur, task, TaskEvent.REQUEUE, actor, failures=0, disruptions=0,
                         dead_lettered=False, reason=None, finished_at=None, not_before=None,
                         deadline_at=None)
    place(cur, pending, "requeue", actor)
    return readers.get(cur, uid)


def resolve_step(cur: Cursor, uid: str, step_name: str, *, mark_done: bool, result: Any,
                 actor: str) -> TaskRecord:
    """The human hand-off of an ambiguous step: it happened (mark done) or it did not (re-run).

    When no flagged step remains, the task is requeued so the next attempt carries on. Refused
    when repeated: `Ledger.resolve_step` runs it once (`transactions.once`).
    """
    task = lock_task(cur, uid)
    found = cur.execute("SELECT idx, state FROM retex.steps WHERE task_uid = %s AND name = %s",
                        (uid, step_name)).fetchone()
    if found is None:
        raise StepNotFound(uid, step_name, "resolve")
    idx: int = found[0]
    if not mark_done and found[1] == StepState.NEEDS_ATTENTION:
        _refuse_rerun_in_flight(cur, uid, step_name, idx, rerun_after_seconds(task.spec["steps"][idx]))
    if mark_done:
        check_result_size(result)
        move_step(cur, uid, idx, StepEvent.RESOLVE_DONE, actor, None,
                  result=Jsonb(result), error=None, finished_at=NOW)
    else:
        move_step(cur, uid, idx, StepEvent.RESOLVE_RERUN, actor, None, error=None)
    still_flagged = cur.execute(
        "SELECT 1 FROM retex.steps WHERE task_uid = %s AND state = 'needs-attention'", (uid,)
    ).fetchone()
    if task.phase == TaskPhase.NEEDS_ATTENTION and not still_flagged:
        task = lock_task(cur, uid)
        pending = transition(cur, task, TaskEvent.REQUEUE, actor, reason=None, finished_at=None)
        place(cur, pending, "requeue", actor)
    return readers.get(cur, uid)


# The worker's reckoning of how long a step's run may still land its effect (its deadline before
# it verifies or re-runs a started step: retex.worker.steps.by_kind.in_flight_seconds and the
# worker's DEADLINE_MARGIN_SECONDS; a unit test holds the two together). The ledger reads the
# spec as stored, with no model: an http request is sent within HTTP_SEND_WITHIN_SECONDS of the
# begin (or its timeout, if shorter) or never.
STEP_TIMEOUT_DEFAULT_SECONDS = 300  # a step's timeoutSeconds when its spec names none
HTTP_SEND_WITHIN_SECONDS = 10.0
IN_FLIGHT_MARGIN_SECONDS = 5.0


def rerun_after_seconds(step_spec: dict[str, Any]) -> float:
    """How long after a step's latest begin (or run) it may be sent again: its timeoutSeconds,
    an http step's send window before that, and the margin."""
    timeout = float(step_spec.get("timeoutSeconds", STEP_TIMEOUT_DEFAULT_SECONDS))
    send_window = min(timeout, HTTP_SEND_WITHIN_SECONDS) if "http" in step_spec else 0.0
    return send_window + timeout + IN_FLIGHT_MARGIN_SECONDS


def _refuse_rerun_in_flight(cur: Cursor, uid: str, step_name: str, idx: int, after_seconds: float) -> None:
    """StepInFlight while the step's latest run (its started_at: the latest begin, or `start_run`
    before a re-run) is not `after_seconds` old on the database's clock."""
    row = cur.execute(
        """SELECT started_at + make_interval(secs => %s), extract(epoch FROM started_at + make_interval(secs => %s) - now())
           FROM retex.steps WHERE task_uid = %s AND idx = %s AND started_at IS NOT NULL""",
        (after_seconds, after_seconds, uid, idx)).fetchone()
    if row is not None and row[1] > 0:
        raise StepInFlight(uid, step_name, rerun_from=row[0], seconds_left=float(row[1]))
