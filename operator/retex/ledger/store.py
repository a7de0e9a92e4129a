"""The step ledger: every operation is one transaction, idempotent when repeated.

Idempotency is what makes the transient-error retry safe: when a connection drops during COMMIT
the caller cannot know whether it landed, so the operation runs again and must find its own
effect already there. Fenced operations (the worker's) lock the task row and check the caller's
epoch first, so a stale attempt is rejected even while a new attempt is being started elsewhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg
from psycopg.types.json import Jsonb

from retex.failpoints import failpoint
from retex.ledger import placement, readers, transactions, worker_operations
from retex.ledger.migrate import migrate
from retex.ledger.moves import (
    NOW,
    cancel_reason,
    check_result_size,
    db_now,
    end_attempt,
    lock_task,
    move_step,
    record_history,
    touch,
)
from retex.ledger.placement import fill_slots, place, start_attempt, transition
from retex.ledger.records import (
    AdmitResult,
    AttemptRecord,
    Dispatch,
    HistoryEntry,
    LedgerFigures,
    Refusal,
    StepRecord,
    TaskAdmission,
    TaskRecord,
    WatchedAttempt,
)
from retex.machine import (
    TERMINAL_PHASES,
    Backoff,
    IllegalTransition,
    StepEvent,
    TaskEvent,
    TaskPhase,
)

T = TypeVar("T")
P = ParamSpec("P")

_CANCEL_REASONS = ("Cancelled", "TaskDeleted")


def step_idempotency_key(uid: str, step_name: str, step_spec: Any) -> str:
    """`<task uid>:<step name>:<version>`: stable across attempts, new if the step changed."""
    version = hashlib.sha256(json.dumps(step_spec, sort_keys=True).encode()).hexdigest()[:8]
    return f"{uid}:{step_name}:{version}"


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


class Ledger:
    """The only door to the ledger tables. Thread-safe; one per process."""

    def __init__(self, dsn: str, *, max_connections: int = 10, retry_for_seconds: float = 120.0):
        self._retry_for = retry_for_seconds
        self._pool = transactions.connection_pool(dsn, max_connections=max_connections)
        self._dsn = dsn

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self, *, migrate_schema: bool = True) -> Ledger:
        if migrate_schema:
            self._retrying(lambda: self._migrate(), op="migrate")
        self._pool.open(wait=False)
        return self

    def _migrate(self) -> list[int]:
        with psycopg.connect(self._dsn) as conn:
            return migrate(conn)

    def close(self) -> None:
        self._pool.close()

    def ping(self, *, timeout: int) -> None:
        """One `SELECT 1` on a connection of its own, within about `timeout` seconds, never retried
        (the readiness probe asks: an outage is its answer, not something to wait out). Not from
        the pool: a pool busy with workers' calls is not Postgres being away. Raises what stopped it."""
        with psycopg.connect(self._dsn, connect_timeout=timeout) as conn:
            conn.execute("SELECT 1")

    def __enter__(self) -> Ledger:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions (retex.ledger.transactions) ---------------------------------------------

    def _retrying(self, fn: Callable[[], T], *, op: str) -> T:
        return transactions.retrying(fn, op=op, retry_for=self._retry_for)

    def _tx(self, fn: Callable[[psycopg.Cursor], T], *, op: str) -> T:
        def attempt() -> T:
            with transactions.transaction(self._pool) as cur:
                return fn(cur)

        return self._retrying(attempt, op=op)

    def _tx_once(self, fn: Callable[[psycopg.Cursor], T], *, uid: str, op: str) -> TaskRecord | T:
        return self._tx(transactions.once(fn, uid=uid), op=op)

    def _run(self, operation: Callable[Concatenate[psycopg.Cursor, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`operation(cur, ...)` in one transaction of its own, retried, named after the operation."""
        return self._tx(lambda cur: operation(cur, *args, **kwargs), op=operation.__name__)

    # What an operation of a test's own writes into history (tests/integration/test_ledger_lifecycle.py).
    _history = staticmethod(record_history)

    # -- admission and attempts (operator) ---------------------------------------------------

    def admit(self, admission: TaskAdmission, *, actor: str = "operator") -> AdmitResult:
        """Insert the task and its steps, then schedule it or start attempt 1 with its dispatch."""

        def op(cur: psycopg.Cursor) -> AdmitResult:
            inserted = cur.execute(
                """INSERT INTO retex.tasks (uid, namespace, name, spec, spec_hash, idempotency_key, phase,
                                            max_attempts, max_disruptions, backoff, not_before,
                                            concurrency_key, priority, timeout_seconds, submitted_at)
                   VALUES (%s, %s, %s, %s, %s, %s, 'Pending', %s, %s, %s, %s, %s, %s, %s, %s)
                   ON CONFLICT DO NOTHING RETURNING *""",
                (admission.uid, admission.namespace, admission.name, Jsonb(admission.spec),
                 spec_hash(admission.spec), admission.idempotency_key, admission.max_attempts,
                 admission.max_disruptions, Jsonb(asdict(admission.backoff)), admission.not_before,
                 admission.concurrency_key, admission.priority, admission.timeout_seconds,
                 admission.submitted_at),
            ).fetchone()
            # Checked after the insert, in its own statement: a purge that committed while the insert
            # waited on the row is seen here (a check before it could miss it).
            verdict = readers.prior_verdict(cur, admission)
            if verdict is not None:
                raise _NotAdmitted(verdict)
            if inserted is None:
                return AdmitResult(uid=admission.uid, created=False)  # admitted before
            step_specs = admission.spec.get("steps") or [None] * len(admission.step_names)
            for idx, (name, step_spec) in enumerate(zip(admission.step_names, step_specs, strict=True)):
                cur.execute(
                    "INSERT INTO retex.steps (task_uid, idx, name, idempotency_key) VALUES (%s, %s, %s, %s)",
                    (admission.uid, idx, name, step_idempotency_key(admission.uid, name, step_spec)),
                )
            record_history(cur, admission.uid, actor, "admit", to_state=TaskPhase.PENDING)
            place(cur, inserted, "first", actor)
            return AdmitResult(uid=admission.uid, created=True)

        try:
            return self._tx(op, op="admit")
        except _NotAdmitted as not_admitted:
            return not_admitted.verdict

    def refuse(self, refusal: Refusal) -> Refusal:
        """Record that a Task is not admitted. Final for its uid: the first refusal stored stands
        (and is returned), and `admit` never admits the uid."""

        def op(cur: psycopg.Cursor) -> Refusal:
            cur.execute(
                """INSERT INTO retex.refusals (uid, namespace, name, reason, message, generation)
                   VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (uid) DO NOTHING""",
                (refusal.uid, refusal.namespace, refusal.name, refusal.reason, refusal.message[:4096],
                 refusal.generation),
            )
            return readers.refusal(cur, refusal.uid)

        return self._tx(op, op="refuse")

    def replace_attempt(self, uid: str, lost_epoch: int, *, cause: str, actor: str = "operator") -> TaskRecord:
        """The attempt `lost_epoch` is gone (lease expired or released, pod disrupted): start the next.

        A disruption does not consume the retry budget; it has its own cap. Repeating the call for
        the same lost epoch changes nothing.
        """

        def op(cur: psycopg.Cursor) -> TaskRecord:
            task = lock_task(cur, uid)
            if task["epoch"] != lost_epoch or task["phase"] != TaskPhase.RUNNING:
                return readers.get(cur, uid)
            end_attempt(cur, uid, lost_epoch, "lost")
            if task["cancel_requested"]:
                transition(cur, task, TaskEvent.CANCEL, actor, reason=cancel_reason(task))
            elif task["disruptions"] + 1 > task["max_disruptions"]:
                transition(cur, task, TaskEvent.FAIL, actor, reason="DisruptionBudgetExhausted",
                                 dead_lettered=True, disruptions=task["disruptions"] + 1,
                                 last_error=f"attempt {lost_epoch} lost ({cause}); disruption cap reached")
            else:
                start_attempt(cur, task, TaskEvent.REPLACE_ATTEMPT, cause, actor,
                                    disruptions=task["disruptions"] + 1)
            return readers.get(cur, uid)

        return self._tx(op, op="replace_attempt")

    def promote_due(self, *, limit: int = 100, actor: str = "operator") -> list[str]:
        """Queue the Scheduled and Retrying tasks whose time has come, fail those past their
        deadline, and fill the free slots. Returns the uids that were due."""

        def op(cur: psycopg.Cursor) -> list[str]:
            overdue = cur.execute(
                """SELECT * FROM retex.tasks WHERE deadline_at <= now()
                   AND phase NOT IN ('Succeeded', 'Failed', 'Cancelled') LIMIT %s FOR UPDATE SKIP LOCKED""",
                (limit,),
            ).fetchall()
            for task in overdue:
                if task["phase"] == TaskPhase.RUNNING:  # its step may still run: keeps slot and key
                    end_attempt(cur, task["uid"], task["epoch"], "failed", settled=False)
                transition(cur, task, TaskEvent.FAIL, actor, reason="Timeout",
                                 last_error=f"task timeout of {task['timeout_seconds']}s exceeded")
            due = cur.execute(
                """SELECT * FROM retex.tasks WHERE phase IN ('Scheduled', 'Retrying') AND not_before <= now()
                   ORDER BY not_before LIMIT %s FOR UPDATE SKIP LOCKED""",
                (limit,),
            ).fetchall()
            for task in due:
                cause = "retry" if task["phase"] == TaskPhase.RETRYING else "first"
                transition(cur, task, TaskEvent.ENQUEUE, actor, next_cause=cause)
            if due:
                fill_slots(cur, actor)
            return [task["uid"] for task in due]

        return self._tx(op, op="promote_due")

    def set_run_limits(self, *, max_running: int | None, max_running_per_namespace: int | None) -> None:
        self._run(placement.set_run_limits, max_running=max_running, max_running_per_namespace=max_running_per_namespace)

    def request_cancel(self, uid: str, *, reason: str = "Cancelled", actor: str = "operator") -> TaskRecord:
        """Waiting tasks are cancelled at once; a running one at its worker's next step boundary
        (or by the reaper at once when its attempt holds no lease). `reason` is what the task ends
        with when the operator ends it: Cancelled, or TaskDeleted for a deletion."""
        if reason not in _CANCEL_REASONS:
            raise ValueError(f"cancel reason {reason!r} is not one of {', '.join(_CANCEL_REASONS)}")

        def op(cur: psycopg.Cursor) -> TaskRecord:
            task = lock_task(cur, uid)
            if task["phase"] in TERMINAL_PHASES or task["cancel_requested"]:
                return readers.get(cur, uid)
            if task["phase"] == TaskPhase.RUNNING:
                touch(cur, uid, cancel_requested=True, cancel_reason=reason)
                record_history(cur, uid, actor, "cancel-requested", epoch=task["epoch"], detail={"reason": reason})
            else:
                transition(cur, task, TaskEvent.CANCEL, actor, reason=reason, cancel_requested=True,
                                 cancel_reason=reason)
            return readers.get(cur, uid)

        return self._tx(op, op="request_cancel")

    def fail_task(self, uid: str, *, reason: str, message: str, actor: str = "operator") -> TaskRecord:
        """Operator-side terminal failure (for example the task timeout). No-op once terminal."""

        def op(cur: psycopg.Cursor) -> TaskRecord:
            task = lock_task(cur, uid)
            if task["phase"] not in TERMINAL_PHASES:
                if task["phase"] == TaskPhase.RUNNING:  # its step may still run: keeps slot and key
                    end_attempt(cur, uid, task["epoch"], "failed", settled=False)
                transition(cur, task, TaskEvent.FAIL, actor, reason=reason, last_error=message)
            return readers.get(cur, uid)

        return self._tx(op, op="fail_task")

    def abandon(self, uid: str, *, reason: str, actor: str = "operator") -> TaskRecord:
        """Cancel now, not at a step boundary (the Task object is gone). A worker still running
        is fenced out at its next write. No-op once terminal or for an unknown task."""

        def op(cur: psycopg.Cursor) -> TaskRecord | None:
            row = cur.execute("SELECT * FROM retex.tasks WHERE uid = %s FOR UPDATE", (uid,)).fetchone()
            if row is None:
                return None
            if row["phase"] not in TERMINAL_PHASES:
                if row["phase"] == TaskPhase.RUNNING:  # its step may still run: keeps slot and key
                    end_attempt(cur, uid, row["epoch"], "cancelled", settled=False)
                transition(cur, row, TaskEvent.CANCEL, actor, reason=reason, cancel_requested=True)
            return readers.get(cur, uid)

        return self._tx(op, op="abandon")

    def requeue(self, uid: str, *, actor: str) -> TaskRecord:
        """A fresh attempt with a fresh budget for a Failed or NeedsAttention task."""

        def op(cur: psycopg.Cursor) -> TaskRecord:
            task = lock_task(cur, uid)
            flagged = cur.execute(
                "SELECT name FROM retex.steps WHERE task_uid = %s AND state = 'needs-attention'", (uid,)
            ).fetchall()
            if flagged:
                names = ", ".join(row["name"] for row in flagged)
                raise IllegalTransition("task", task["phase"], f"requeue before resolving step(s) {names}")
            pending = transition(cur, task, TaskEvent.REQUEUE, actor, failures=0, disruptions=0,
                                       dead_lettered=False, reason=None, finished_at=None, not_before=None,
                                       deadline_at=None)
            place(cur, pending, "requeue", actor)
            return readers.get(cur, uid)

        return self._tx_once(op, uid=uid, op="requeue")

    def resolve_step(self, uid: str, step_name: str, *, mark_done: bool, result: Any = None,
                     actor: str) -> TaskRecord:
        """The human hand-off of an ambiguous step: it happened (mark done) or it did not (re-run).

        When no flagged step remains, the task is requeued so the next attempt carries on.
        """

        def op(cur: psycopg.Cursor) -> TaskRecord:
            task = lock_task(cur, uid)
            step = cur.execute("SELECT idx FROM retex.steps WHERE task_uid = %s AND name = %s",
                               (uid, step_name)).fetchone()
            if step is None:
                raise IllegalTransition("step", "missing", f"resolve of unknown step {step_name!r}")
            if mark_done:
                check_result_size(result)
                move_step(cur, uid, step["idx"], StepEvent.RESOLVE_DONE, actor, None,
                                result=Jsonb(result), error=None, finished_at=NOW)
            else:
                move_step(cur, uid, step["idx"], StepEvent.RESOLVE_RERUN, actor, None, error=None)
            still_flagged = cur.execute(
                "SELECT 1 FROM retex.steps WHERE task_uid = %s AND state = 'needs-attention'", (uid,)
            ).fetchone()
            if task["phase"] == TaskPhase.NEEDS_ATTENTION and not still_flagged:
                task = lock_task(cur, uid)
                pending = transition(cur, task, TaskEvent.REQUEUE, actor, reason=None, finished_at=None)
                place(cur, pending, "requeue", actor)
            return readers.get(cur, uid)

        return self._tx_once(op, uid=uid, op="resolve_step")

    # -- attempt lifecycle (operator: the reaper and the promoter) -----------------------------

    def settle_attempt(self, uid: str, epoch: int, *, actor: str = "operator") -> None:
        """Attempt `epoch`, already ended by the operator, is known dead: free its slot and key."""

        def op(cur: psycopg.Cursor) -> None:
            settled = cur.execute(
                """UPDATE retex.attempts SET settled_at = now() WHERE task_uid = %s AND epoch = %s
                   AND outcome IS NOT NULL AND settled_at IS NULL""", (uid, epoch)).rowcount
            if settled:
                record_history(cur, uid, actor, "attempt-settled", epoch=epoch)
                fill_slots(cur, actor)

        self._tx(op, op="settle_attempt")

    def fail_unstarted(self, uid: str, epoch: int, error: str, *, actor: str = "operator",
                       rng: random.Random | None = None) -> TaskRecord:
        """Attempt `epoch` never took its lease in time (its pod could not start: image, config,
        scheduling, quota). A failed attempt, counted against the retry budget like a step failure
        (a broken spec would otherwise loop for ever); a cancel request makes it Cancelled.
        No-op unless `epoch` is current and Running and its worker has not claimed it: a slow
        worker may take the lease and claim the attempt (under this row lock) after the caller
        saw no lease, and may then be inside a step."""

        def op(cur: psycopg.Cursor) -> TaskRecord:
            task = lock_task(cur, uid)
            if task["epoch"] != epoch or task["phase"] != TaskPhase.RUNNING:
                return readers.get(cur, uid)
            if cur.execute("SELECT pod FROM retex.attempts WHERE task_uid = %s AND epoch = %s",
                           (uid, epoch)).fetchone()["pod"] is not None:
                return readers.get(cur, uid)
            end_attempt(cur, uid, epoch, "failed")  # it never held the lease: no step can run
            failures = task["failures"] + 1
            if task["cancel_requested"]:
                transition(cur, task, TaskEvent.CANCEL, actor, reason=cancel_reason(task))
            elif failures >= task["max_attempts"]:
                transition(cur, task, TaskEvent.FAIL, actor, reason="RetriesExhausted", failures=failures,
                                 dead_lettered=True, last_error=error[:4096])
            else:
                delay = Backoff(**task["backoff"]).delay(failures, rng)
                transition(cur, task, TaskEvent.RETRY, actor, detail={"backoffSeconds": round(delay, 3)},
                                 reason="WorkerNotStarted", failures=failures, last_error=error[:4096],
                                 not_before=db_now(cur) + timedelta(seconds=delay))
            return readers.get(cur, uid)

        return self._tx(op, op="fail_unstarted")

    def cancel_unheld(self, uid: str, epoch: int, *, actor: str = "operator") -> TaskRecord:
        """A cancel (or delete) was requested and attempt `epoch` holds no lease (never took it, or
        its worker is gone): no worker will reach a step boundary, so the task ends now with its
        cancel reason. A worker that starts later is fenced at its first write.
        No-op unless `epoch` is current, Running and cancel was requested."""

        def op(cur: psycopg.Cursor) -> TaskRecord:
            task = lock_task(cur, uid)
            if task["epoch"] != epoch or task["phase"] != TaskPhase.RUNNING or not task["cancel_requested"]:
                return readers.get(cur, uid)
            end_attempt(cur, uid, epoch, "cancelled")
            transition(cur, task, TaskEvent.CANCEL, actor, reason=cancel_reason(task))
            return readers.get(cur, uid)

        return self._tx(op, op="cancel_unheld")

    def fill_slots(self, *, actor: str = "operator") -> None:
        """Start what may start: the periodic backstop for a placement that skipped a briefly
        locked queue head (SKIP LOCKED) or a slot freed where no placement followed."""
        self._run(placement.fill_slots, actor)

    # -- the outbox relay (operator) ---------------------------------------------------------

    @contextlib.contextmanager
    def dispatch_batch(self, *, limit: int = 20) -> Iterator[tuple[list[Dispatch], DispatchOutcomes]]:
        """Claim unsent dispatch records that are due (`FOR UPDATE SKIP LOCKED`) inside one open
        transaction.

        Yields the records that are still current and a `DispatchOutcomes` on which the caller
        settles each record on its own: sent, rejected (the task fails), dropped (the task is
        cancelled) or deferred (that record alone is retried later). A record left unsettled
        stays unsent and is claimed again. Records whose epoch was superseded are marked stale
        and not yielded; a record of a task whose cancel was requested carries its cancel reason
        (the relay drops it, after looking for a Job a dead relay may have created).
        If the caller dies before the transaction commits, the claims vanish with it and another
        relay sends them again; the deterministic Job name turns that into AlreadyExists, which
        is success.
        """
        with transactions.transaction(self._pool) as cur:
            rows = cur.execute(
                """SELECT o.id, o.task_uid, o.epoch, o.attempts, t.namespace, t.name, t.spec, t.deadline_at,
                          extract(epoch FROM now() - o.deferred_since)::float8 AS deferred_seconds,
                          t.cancel_requested, t.cancel_reason, (o.epoch = t.epoch AND t.phase = 'Running') AS current
                   FROM retex.outbox o JOIN retex.tasks t ON t.uid = o.task_uid
                   WHERE o.sent_at IS NULL AND (o.not_before IS NULL OR o.not_before <= now())
                   ORDER BY o.id LIMIT %s FOR UPDATE OF o SKIP LOCKED""",
                (limit,),
            ).fetchall()
            stale = [row["id"] for row in rows if not row["current"]]
            if stale:
                cur.execute("UPDATE retex.outbox SET sent_at = now(), outcome = 'stale' WHERE id = ANY(%s)", (stale,))
            outcomes = DispatchOutcomes(cur, {row["id"]: row["attempts"] for row in rows})
            yield [Dispatch(id=r["id"], task_uid=r["task_uid"], epoch=r["epoch"], namespace=r["namespace"],
                            name=r["name"], spec=r["spec"], deadline_at=r["deadline_at"],
                            deferred_seconds=r["deferred_seconds"],
                            cancel_reason=(r["cancel_reason"] or "Cancelled") if r["cancel_requested"] else None)
                   for r in rows if r["current"]], outcomes

    # -- the worker's operations (retex.ledger.worker_operations) ----------------------------------

    def claim_attempt(self, uid: str, epoch: int, *, pod: str, node: str | None) -> TaskRecord:
        return self._run(worker_operations.claim_attempt, uid, epoch, pod=pod, node=node)

    def begin_step(self, uid: str, epoch: int, idx: int, *, actor: str, request: str | None = None) -> StepRecord:
        prior, name = self._run(worker_operations.begin_step, uid, epoch, idx, actor=actor, request=request)
        failpoint("after-begin-commit", prior.name, task=name, uid=uid)  # crash-matrix R8b: committed, no reply
        return prior

    def start_run(self, uid: str, epoch: int, idx: int, *, actor: str) -> None:
        self._run(worker_operations.start_run, uid, epoch, idx, actor=actor)

    def seconds_until_step_deadline(self, uid: str, idx: int, *, begun_at: datetime | None,
                                    after_seconds: float) -> float:
        return self._run(worker_operations.seconds_until_step_deadline, uid, idx, begun_at=begun_at,
                         after_seconds=after_seconds)

    def commit_step(self, uid: str, epoch: int, idx: int, result: Any, *, actor: str) -> None:
        check_result_size(result)
        with worker_operations.refusal_as_unstorable():
            self._run(worker_operations.commit_step, uid, epoch, idx, result, actor=actor)

    def fail_step(self, uid: str, epoch: int, idx: int, error: str, *, retryable: bool, actor: str,
                  rng: random.Random | None = None) -> TaskRecord:
        with worker_operations.refusal_as_unstorable():
            return self._run(worker_operations.fail_step, uid, epoch, idx, error, retryable=retryable, actor=actor,
                             rng=rng)

    def flag_step(self, uid: str, epoch: int, idx: int, why: str, *, actor: str) -> TaskRecord:
        with worker_operations.refusal_as_unstorable():
            return self._run(worker_operations.flag_step, uid, epoch, idx, why, actor=actor)

    def complete_task(self, uid: str, epoch: int, *, actor: str) -> TaskRecord:
        return self._run(worker_operations.complete_task, uid, epoch, actor=actor)

    def finish_cancelled(self, uid: str, epoch: int, *, actor: str) -> TaskRecord:
        return self._run(worker_operations.finish_cancelled, uid, epoch, actor=actor)

    # -- readers (retex.ledger.readers) ------------------------------------------------------

    def get(self, uid: str) -> TaskRecord:
        return self._run(readers.get, uid)

    def find(self, namespace: str, name: str) -> TaskRecord | None:
        return self._run(readers.find, namespace, name)

    def running(self) -> list[TaskRecord]:
        return self._run(readers.running)

    def versions(self) -> dict[str, int]:
        return self._run(readers.versions)

    def attempts(self, uid: str) -> list[AttemptRecord]:
        return self._run(readers.attempts, uid)

    def history(self, uid: str) -> list[HistoryEntry]:
        return self._run(readers.history, uid)

    def dead_letters(self, namespace: str | None = None) -> list[TaskRecord]:
        return self._run(readers.dead_letters, namespace)

    def watched(self) -> list[WatchedAttempt]:
        return self._run(readers.watched)

    def next_due_at(self) -> datetime | None:
        return self._run(readers.next_due_at)

    def seconds_until(self, at: datetime) -> float:
        return self._run(readers.seconds_until, at)

    def prior_verdict(self, admission: TaskAdmission) -> AdmitResult | None:
        return self._run(readers.prior_verdict, admission)

    def refusal(self, uid: str) -> Refusal | None:
        return self._run(readers.refusal, uid)

    def figures(self) -> LedgerFigures:
        return self._run(readers.figures)

    def listen(self, *, timeout: float = 1.0) -> Iterator[tuple[str, int] | None]:
        return readers.listen(self._dsn, timeout=timeout)

    def purge_finished(self, *, older_than_seconds: float) -> int:
        """Delete tasks (with their steps, attempts and history) that ended that long ago: the
        history-retention setting. Each leaves a tombstone (uid, name, final phase, idempotencyKey)
        that is kept forever, and what its rows counted is added to retex.purged_tallies (so the
        exported counters do not go down). Returns how many went."""

        def op(cur: psycopg.Cursor) -> int:
            # Locked, so a requeue cannot move one of them between its count and its delete.
            uids = [row["uid"] for row in cur.execute(
                """SELECT uid FROM retex.tasks WHERE phase IN ('Succeeded', 'Failed', 'Cancelled')
                   AND finished_at < now() - make_interval(secs => %s) FOR UPDATE""",
                (older_than_seconds,),
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
            return cur.execute(
                """WITH gone AS (
                       DELETE FROM retex.tasks WHERE uid = ANY(%s)
                       RETURNING uid, namespace, name, phase, idempotency_key)
                   INSERT INTO retex.tombstones (uid, namespace, name, phase, idempotency_key)
                   SELECT uid, namespace, name, phase, idempotency_key FROM gone ON CONFLICT DO NOTHING""",
                (uids,),
            ).rowcount

        return self._tx(op, op="purge_finished")


# A record deferred n times waits min(cap, base·2^(n-1)) seconds: a transient refusal of one Job
# costs that record a retry, never the records behind it.
DISPATCH_RETRY_BASE_SECONDS = 1.0
DISPATCH_RETRY_CAP_SECONDS = 60.0


class DispatchOutcomes:
    """How the relay settles each claimed record, in the batch's transaction. Each settlement
    runs in its own savepoint, so one that fails leaves the others (and the claim) intact."""

    def __init__(self, cur: psycopg.Cursor, attempts: dict[int, int]):
        self._cur, self._attempts = cur, attempts
        self.claimed = len(attempts)  # records claimed, settled by the ledger (stale, dropped) or not

    def _settle(self, dispatch: Dispatch, outcome: str) -> None:
        self._cur.execute("UPDATE retex.outbox SET sent_at = now(), outcome = %s WHERE id = %s",
                          (outcome, dispatch.id))

    def _current_task(self, dispatch: Dispatch) -> dict[str, Any] | None:
        task = lock_task(self._cur, dispatch.task_uid)
        if task["epoch"] != dispatch.epoch or task["phase"] != TaskPhase.RUNNING:
            return None  # moved on since the claim (replaced, timed out): nothing to end
        return task

    def _end_attempt(self, dispatch: Dispatch, outcome: str, job_name: str | None) -> None:
        """End the attempt of a record that was not sent. `job_name`: a Job was found for it after
        all (a relay died between creating it and its commit, crash-matrix R3) and deleted; its
        worker may be inside a step, so the attempt holds its slot and key until known dead."""
        end_attempt(self._cur, dispatch.task_uid, dispatch.epoch, outcome, settled=job_name is None)
        if job_name is not None:
            self._cur.execute("UPDATE retex.attempts SET job_name = %s WHERE task_uid = %s AND epoch = %s",
                              (job_name, dispatch.task_uid, dispatch.epoch))

    def sent(self, dispatch: Dispatch, job_name: str) -> None:
        with self._cur.connection.transaction():
            self._settle(dispatch, "sent")
            self._cur.execute("UPDATE retex.attempts SET job_name = %s WHERE task_uid = %s AND epoch = %s",
                              (job_name, dispatch.task_uid, dispatch.epoch))

    def rejected(self, dispatch: Dispatch, message: str, *, reason: str = "JobRejected",
                 job_name: str | None = None, actor: str = "operator") -> None:
        """The attempt's Job cannot be created: the API server refused it for good (JobRejected:
        invalid, forbidden, namespace gone), or it could not be dispatched at all (DispatchFailed:
        deferred past the cap, or a failure repeating cannot cure). The task fails with `reason`
        and `message`. Not dead-lettered: no budget was spent; fix the cause, then requeue."""
        with self._cur.connection.transaction():
            task = self._current_task(dispatch)
            if task is not None:
                self._end_attempt(dispatch, "failed", job_name)
                transition(self._cur, task, TaskEvent.FAIL, actor, reason=reason, last_error=message[:4096])
            self._settle(dispatch, "rejected")
            self._cur.execute("UPDATE retex.outbox SET last_error = %s WHERE id = %s", (message[:4096], dispatch.id))

    def dropped(self, dispatch: Dispatch, *, reason: str, job_name: str | None = None,
                actor: str = "operator") -> None:
        """Not sent: the task was cancelled or deleted (`reason` Cancelled or TaskDeleted) or its
        Task object is gone. It ends Cancelled now: no Job of its remains, so no worker will
        reach a step boundary."""
        with self._cur.connection.transaction():
            task = self._current_task(dispatch)
            if task is not None:
                self._end_attempt(dispatch, "cancelled", job_name)
                transition(self._cur, task, TaskEvent.CANCEL, actor, reason=reason, cancel_requested=True)
            self._settle(dispatch, "dropped")

    def deferred(self, dispatch: Dispatch, error: str) -> float:
        """A transient failure (API server busy or unreachable): this record waits out its own
        backoff; the records behind it go on. Returns the delay in seconds. The first deferral's
        time is kept (`deferred_since`): the relay gives the record up past its cap."""
        tries = self._attempts.get(dispatch.id, 0) + 1
        delay = min(DISPATCH_RETRY_CAP_SECONDS, DISPATCH_RETRY_BASE_SECONDS * 2 ** (tries - 1))
        with self._cur.connection.transaction():
            self._cur.execute(
                "UPDATE retex.outbox SET attempts = %s, not_before = now() + make_interval(secs => %s), "
                "last_error = %s, deferred_since = coalesce(deferred_since, now()) WHERE id = %s",
                (tries, delay, error[:4096], dispatch.id),
            )
        return delay


class _NotAdmitted(Exception):
    """Inside `admit`: the task must not be admitted; rolls the transaction back."""

    def __init__(self, verdict: AdmitResult):
        super().__init__(verdict)
        self.verdict = verdict
