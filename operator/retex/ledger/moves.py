"""The moves every operation shares, always inside the caller's transaction: lock the task row,
check the fence, move a step, end an attempt, write history. A task's phase moves in
retex.ledger.placement (`transition`), because leaving a phase may free a run slot."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from retex.ledger.errors import FenceRejected, ResultTooLarge, StepNotFound, TaskNotFound
from retex.ledger.records import RESULT_LIMIT_BYTES
from retex.ledger.rows import Cursor, StepLock, StepRow, TaskRow, column_list, fetch_one, scalar
from retex.machine import StepEvent, TaskPhase, step_transition


class DatabaseTime:
    """A column value the database sets when the UPDATE runs (`set_clause`), on its own clock."""

    def __init__(self, expression: str):
        self.expression = expression


# The transaction's start.
NOW = DatabaseTime("now()")
# The moment of the write itself, after any lock wait of the transaction.
WRITE_TIME = DatabaseTime("clock_timestamp()")


_LOCK_TASK = f"SELECT {column_list(TaskRow)} FROM retex.tasks WHERE uid = %s FOR UPDATE"


def lock_task(cur: Cursor, uid: str) -> TaskRow:
    row = lock_task_if_any(cur, uid)
    if row is None:
        raise TaskNotFound(uid)
    return row


def lock_task_if_any(cur: Cursor, uid: str) -> TaskRow | None:
    return fetch_one(cur, TaskRow, _LOCK_TASK, (uid,))


def fence(task: TaskRow, epoch: int) -> None:
    """A worker's write goes through only for the task's current epoch while it is Running and
    not frozen: a frozen task's ledger is behind what its Task showed, so nothing may step on it."""
    if task.frozen_reason is not None:
        raise FenceRejected(task.uid, epoch, task.epoch, f"{task.phase}, frozen: {task.frozen_reason}")
    if task.epoch != epoch or task.phase != TaskPhase.RUNNING:
        raise FenceRejected(task.uid, epoch, task.epoch, task.phase)


_HISTORY_INSERT = """INSERT INTO retex.history (task_uid, actor, event, epoch, step_idx, from_state, to_state, detail)
                     VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"""
_TOUCH = "UPDATE retex.tasks SET version = version + 1, updated_at = now(){assignments} WHERE uid = %s"


def record_history(cur: Cursor, uid: str, actor: str, event: str, *, epoch: int | None = None,
                   step_idx: int | None = None, from_state: str | None = None, to_state: str | None = None,
                   detail: dict[str, Any] | None = None) -> None:
    cur.execute(_HISTORY_INSERT,
                (uid, actor, event, epoch, step_idx, from_state, to_state, Jsonb(detail) if detail else None))


def touch(cur: Cursor, uid: str, **columns: Any) -> None:
    """Bump the task's version (a step changed, or a flag did): the mirror must see it."""
    assignments = "".join(f", {col} = %s" for col in columns)
    cur.execute(_TOUCH.format(assignments=assignments), (*[adapt(v) for v in columns.values()], uid))


def lock_step(cur: Cursor, uid: str, idx: int, event: StepEvent) -> StepLock:
    """The step's state and name, its row locked (after the task's: the caller holds that)."""
    step = fetch_one(cur, StepLock, f"SELECT {column_list(StepLock)} FROM retex.steps WHERE task_uid = %s AND idx = %s "
                     "FOR UPDATE", (uid, idx))
    if step is None:
        raise StepNotFound(uid, idx, event)
    return step


def move_step(cur: Cursor, uid: str, idx: int, event: StepEvent, actor: str,
              epoch: int | None, *, locked_state: str | None = None, **columns: Any) -> StepRow:
    """Move step `idx` by `event` to the state the machine says, set `columns`, record it in
    history and bump the task's version. The caller holds the task row lock; the step's row
    is locked here (`lock_step`), unless the caller did and passes the `locked_state` it read.
    The update, its history row and the version are one statement: one round trip."""
    if locked_state is None:
        locked_state = lock_step(cur, uid, idx, event).state
    new_state = step_transition(locked_state, event)
    columns["state"] = str(new_state)
    assignments, parameters = set_clause(columns)
    moved = fetch_one(
        cur, StepRow,
        f"""WITH moved AS (UPDATE retex.steps SET {assignments} WHERE task_uid = %s AND idx = %s
                           RETURNING {column_list(StepRow)}),
                 recorded AS ({_HISTORY_INSERT}),
                 touched AS ({_TOUCH.format(assignments="")})
            SELECT {column_list(StepRow)} FROM moved""",
        (*parameters, uid, idx,
         uid, actor, f"step-{event}", epoch, idx, str(locked_state), str(new_state), None,
         uid),
    )
    if moved is None:
        raise StepNotFound(uid, idx, event)
    return moved


def end_attempt(cur: Cursor, uid: str, epoch: int, outcome: str, *, settled: bool = True) -> None:
    """Record the attempt's outcome. `settled`: it is known dead (its worker ended it, or its
    lease was released or expired, or it never held it). The operator ending an attempt whose
    worker may still be inside a step passes False; the reaper settles it later."""
    cur.execute(
        "UPDATE retex.attempts SET outcome = %s, ended_at = now(), settled_at = CASE WHEN %s THEN now() END "
        "WHERE task_uid = %s AND epoch = %s AND outcome IS NULL",
        (outcome, settled, uid, epoch),
    )


def set_clause(columns: dict[str, Any]) -> tuple[str, list[Any]]:
    """`col = %s, ...` and its values for an UPDATE; a `DatabaseTime` (`NOW`, `WRITE_TIME`) is
    the database's own expression."""
    assignments = ", ".join(f"{col} = {val.expression}" if isinstance(val, DatabaseTime) else f"{col} = %s"
                            for col, val in columns.items())
    return assignments, [adapt(val) for val in columns.values() if not isinstance(val, DatabaseTime)]


def adapt(value: Any) -> Any:
    return Jsonb(value) if isinstance(value, dict | list) else value


def cancel_reason(task: TaskRow) -> str:
    """What a task whose cancel was requested ends with: TaskDeleted when its Task was deleted."""
    return task.cancel_reason or "Cancelled"


def db_now(cur: Cursor) -> datetime:
    now: datetime = scalar(cur.execute("SELECT now()"))
    return now


def check_result_size(result: Any) -> None:
    size = len(json.dumps(result).encode())
    if size > RESULT_LIMIT_BYTES:
        raise ResultTooLarge(f"step result is {size} bytes; the limit is {RESULT_LIMIT_BYTES} (store large data by reference)")
