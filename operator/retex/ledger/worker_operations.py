"""The worker's operations: the one home of what a worker may do to the ledger. The operator's
ledger endpoint runs them (through `Ledger`) for the attempt a worker pod's token names;
retex.ledger.wire lists them (with the reader `get`) as the operations a request may name.

Every write is fenced: it locks the task row and checks the caller's epoch first (`fence`), so
a stale attempt is rejected even while a new attempt is being started elsewhere. Each is
idempotent when repeated: a repeated call (its reply was lost) finds its own effect and returns."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from retex.failpoints import failpoint
from retex.ledger import readers
from retex.ledger.errors import CancelRequested, StepNotFound, StepOutOfOrder, TaskNotFound, UnstorableValue
from retex.ledger.moves import (
    NOW,
    WRITE_TIME,
    cancel_reason,
    end_attempt,
    fence,
    lock_step,
    lock_task,
    move_step,
    record_history,
    touch,
)
from retex.ledger.placement import retry_or_fail, transition
from retex.ledger.records import StepRecord, TaskRecord
from retex.ledger.rows import Cursor, StepRow, StepToBegin, column_list, fetch_one, scalar
from retex.machine import IllegalTransition, StepEvent, StepState, TaskEvent, TaskPhase


@contextlib.contextmanager
def refusal_as_unstorable() -> Iterator[None]:
    """A value Postgres (or psycopg, before sending) refuses: NUL in text, NaN or \\u0000 in
    jsonb, a lone surrogate. Not transient: repeating the write cannot help."""
    try:
        yield
    except (psycopg.DataError, UnicodeEncodeError) as exc:
        raise UnstorableValue(f"the ledger refused the value: {type(exc).__name__}: {exc}") from exc


def claim_attempt(cur: Cursor, uid: str, epoch: int, *, pod: str, node: str | None) -> TaskRecord:
    """Read the task for attempt `epoch` and record which pod runs it. Fenced."""
    task = lock_task(cur, uid)
    fence(task, epoch)
    cur.execute("UPDATE retex.attempts SET pod = %s, node = %s WHERE task_uid = %s AND epoch = %s",
                (pod, node, uid, epoch))
    return readers.get(cur, uid)


def begin_step(cur: Cursor, uid: str, epoch: int, idx: int, *, actor: str,
               request: str | None) -> tuple[StepRecord, str]:
    """Mark step `idx` started by this attempt; returns it as it was before, and the task's name
    (for the failpoint after the commit). Fenced.

    `request` names this call: the same call sent again (its reply was lost) gets the same
    answer. Without it, or with another, a repeat finds the step started by this attempt and
    returns that: the caller treats the step as interrupted (another process of the attempt,
    or a begin whose answer nobody kept)."""
    task = lock_task(cur, uid)
    fence(task, epoch)
    if task.cancel_requested:
        raise CancelRequested(uid)
    # This step's row, locked as `move_step` would, and how many steps ahead of it are not done:
    # one row and a count, not every step with its result.
    row = fetch_one(
        cur, StepToBegin,
        f"""SELECT {column_list(StepRow, "s")}, (SELECT count(*) FROM retex.steps ahead WHERE ahead.task_uid = s.task_uid
                        AND ahead.idx < s.idx AND ahead.state <> 'done') AS undone_ahead
            FROM retex.steps s WHERE s.task_uid = %s AND s.idx = %s FOR UPDATE OF s""",
        (uid, idx))
    if row is None:
        raise StepNotFound(uid, idx, StepEvent.BEGIN)
    prior = readers.step_record(row)
    if prior.state == StepState.STARTED and prior.attempt == epoch:
        if request is not None and row.begin_request == request:  # the same call again
            assert row.prior_state is not None, "written with begin_request, from a NOT NULL column"
            return replace(prior, state=StepState(row.prior_state), attempt=row.prior_attempt,
                           started_at=row.prior_started_at), task.name
        return prior, task.name  # a repeated call
    if row.undone_ahead:
        raise StepOutOfOrder(f"step {idx} of {uid} cannot begin before the steps ahead of it are done")
    # started_at: the moment of this write, not the transaction's start (now(), before the lock
    # wait): a later attempt's deadline wait counts from it.
    move_step(cur, uid, idx, StepEvent.BEGIN, actor, epoch, locked_state=row.state, attempt=epoch, error=None,
              started_at=WRITE_TIME, begin_request=request, prior_state=prior.state, prior_attempt=prior.attempt,
              prior_started_at=prior.started_at)
    return prior, task.name


def start_run(cur: Cursor, uid: str, epoch: int, idx: int, *, actor: str) -> None:
    """Step `idx`, begun by this attempt and found `started` from an earlier one, is about to
    run now (after its verify found nothing, or as an idempotent re-run): its started_at
    becomes this moment, so a later attempt waits out this run's deadline, not the begin's.
    Fenced: a run whose start is not recorded before a newer epoch exists never runs.

    Once per step and attempt (a worker runs a step at most once per attempt): a repeat is a
    repeated call and writes nothing. The endpoint takes this call from any code holding the
    pod's token, step code included; each start was a history row, a version bump and a NOTIFY."""
    task = lock_task(cur, uid)
    fence(task, epoch)
    step = cur.execute("SELECT state, attempt FROM retex.steps WHERE task_uid = %s AND idx = %s FOR UPDATE",
                       (uid, idx)).fetchone()
    if step is None or tuple(step) != (StepState.STARTED.value, epoch):
        raise IllegalTransition("step", "not started by this attempt", f"start a run of step {idx}")
    if cur.execute("""SELECT 1 FROM retex.history WHERE task_uid = %s AND event = 'step-run' AND epoch = %s
                      AND step_idx = %s LIMIT 1""", (uid, epoch, idx)).fetchone():
        return  # a repeated call
    cur.execute("UPDATE retex.steps SET started_at = clock_timestamp() WHERE task_uid = %s AND idx = %s", (uid, idx))
    record_history(cur, uid, actor, "step-run", epoch=epoch, step_idx=idx)
    touch(cur, uid)


def seconds_until_step_deadline(cur: Cursor, uid: str, idx: int, *, begun_at: datetime | None,
                                after_seconds: float) -> float:
    """Seconds left, by the database's clock, until `after_seconds` past the step's begin
    (`begun_at` as an earlier `begin_step` returned it, else the step row's own started_at);
    0 once that has passed. The worker waits it out before verifying a step that may still be
    in flight: its own clock is never compared with the database's. Unfenced reader."""
    row = cur.execute(
        """SELECT greatest(0, extract(epoch FROM coalesce(%s::timestamptz, started_at)
                          + make_interval(secs => %s) - now())) AS left
           FROM retex.steps WHERE task_uid = %s AND idx = %s""",
        (begun_at, after_seconds, uid, idx),
    ).fetchone()
    if row is None:
        raise TaskNotFound(uid)
    return float(row[0] or 0)


def commit_step(cur: Cursor, uid: str, epoch: int, idx: int, result: Any, *, actor: str) -> None:
    """Record the step's result: the one durable proof that its effect happened. Fenced. The
    result's size is checked before the transaction (`Ledger.commit_step`: `check_result_size`)."""
    task = lock_task(cur, uid)
    fence(task, epoch)
    step = lock_step(cur, uid, idx, StepEvent.COMMIT)
    if step.state == StepState.DONE:
        return  # a repeated call
    move_step(cur, uid, idx, StepEvent.COMMIT, actor, epoch, locked_state=step.state, result=Jsonb(result),
              error=None, finished_at=NOW)
    failpoint("in-commit", step.name, task=task.name, uid=uid)  # crash-matrix R8: dies before COMMIT


def fail_step(cur: Cursor, uid: str, epoch: int, idx: int, error: str, *, retryable: bool, actor: str,
              rng: random.Random | None) -> TaskRecord:
    """The step failed: retry after backoff, or fail the task (permanently or out of budget). Fenced."""
    task = lock_task(cur, uid)
    state, attempt = cur.execute("SELECT state, attempt FROM retex.steps WHERE task_uid = %s AND idx = %s",
                                 (uid, idx)).fetchone() or (None, None)
    if state == StepState.FAILED and attempt == epoch and task.epoch == epoch:
        return readers.get(cur, uid)  # a repeated call
    fence(task, epoch)
    move_step(cur, uid, idx, StepEvent.FAIL, actor, epoch, error=error[:4096], finished_at=NOW)
    end_attempt(cur, uid, epoch, "failed")
    failures = task.failures + 1
    task = lock_task(cur, uid)
    if not retryable:
        transition(cur, task, TaskEvent.FAIL, actor, reason="PermanentError", failures=failures,
                   last_error=error[:4096])
    else:
        retry_or_fail(cur, task, failures, error, retry_reason="RetryableError", actor=actor, rng=rng)
    return readers.get(cur, uid)


def flag_step(cur: Cursor, uid: str, epoch: int, idx: int, why: str, *, actor: str) -> TaskRecord:
    """An ambiguous step that is neither verifiable nor idempotent: stop for a human. Fenced."""
    task = lock_task(cur, uid)
    if task.phase == TaskPhase.NEEDS_ATTENTION and task.epoch == epoch:
        return readers.get(cur, uid)  # a repeated call
    fence(task, epoch)
    move_step(cur, uid, idx, StepEvent.FLAG, actor, epoch, error=why[:4096])
    end_attempt(cur, uid, epoch, "needs-attention")
    task = lock_task(cur, uid)
    transition(cur, task, TaskEvent.NEED_ATTENTION, actor, reason="AmbiguousStep", last_error=why[:4096])
    return readers.get(cur, uid)


def complete_task(cur: Cursor, uid: str, epoch: int, *, actor: str) -> TaskRecord:
    """Every step is done: the task Succeeded. Fenced."""
    task = lock_task(cur, uid)
    if task.phase == TaskPhase.SUCCEEDED and task.epoch == epoch:
        return readers.get(cur, uid)  # a repeated call
    fence(task, epoch)
    undone = scalar(cur.execute("SELECT count(*) FROM retex.steps WHERE task_uid = %s AND state <> 'done'",
                                (uid,)))
    if undone:
        raise IllegalTransition("task", task.phase, f"succeed with {undone} step(s) not done")
    end_attempt(cur, uid, epoch, "succeeded")
    transition(cur, task, TaskEvent.SUCCEED, actor, reason="Completed")
    return readers.get(cur, uid)


def finish_cancelled(cur: Cursor, uid: str, epoch: int, *, actor: str) -> TaskRecord:
    """The worker stopped at a step boundary because cancel was requested. Fenced."""
    task = lock_task(cur, uid)
    if task.phase == TaskPhase.CANCELLED and task.epoch == epoch:
        return readers.get(cur, uid)  # a repeated call
    fence(task, epoch)
    if not task.cancel_requested:
        raise IllegalTransition("task", task.phase, "cancel without a cancel request")
    end_attempt(cur, uid, epoch, "cancelled")
    transition(cur, task, TaskEvent.CANCEL, actor, reason=cancel_reason(task))
    return readers.get(cur, uid)
