"""The moves every operation shares, always inside the caller's transaction: lock the task row,
check the fence, move a step, end an attempt, write history. A task's phase moves in
retex.ledger.placement (`transition`), because leaving a phase may free a run slot."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from retex.ledger.errors import FenceRejected, ResultTooLarge, TaskNotFound
from retex.ledger.records import RESULT_LIMIT_BYTES
from retex.machine import IllegalTransition, StepEvent, TaskPhase, step_transition

# The cursors of every operation: the pool hands out connections whose rows are dicts.
Cursor = psycopg.Cursor[DictRow]


def one(cur: Cursor) -> dict[str, Any]:
    """The row of a statement that always returns one (an aggregate, RETURNING of a locked row)."""
    row = cur.fetchone()
    if row is None:
        raise LookupError("the statement returned no row")
    return row

# A marker for "SET col = now()" in the generic UPDATE builders, so the database clock is used.
NOW = object()


def lock_task(cur: Cursor, uid: str) -> dict[str, Any]:
    row = cur.execute("SELECT * FROM retex.tasks WHERE uid = %s FOR UPDATE", (uid,)).fetchone()
    if row is None:
        raise TaskNotFound(uid)
    return row


def fence(task: dict[str, Any], epoch: int) -> None:
    if task["epoch"] != epoch or task["phase"] != TaskPhase.RUNNING:
        raise FenceRejected(task["uid"], epoch, task["epoch"], task["phase"])


def record_history(cur: Cursor, uid: str, actor: str, event: str, *, epoch: int | None = None,
                   step_idx: int | None = None, from_state: str | None = None, to_state: str | None = None,
                   detail: dict[str, Any] | None = None) -> None:
    cur.execute(
        """INSERT INTO retex.history (task_uid, actor, event, epoch, step_idx, from_state, to_state, detail)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s)""",
        (uid, actor, event, epoch, step_idx, from_state, to_state, Jsonb(detail) if detail else None),
    )


def touch(cur: Cursor, uid: str, **columns: Any) -> None:
    """Bump the task's version (a step changed, or a flag did): the mirror must see it."""
    assignments = "".join(f", {col} = %s" for col in columns)
    cur.execute(
        f"UPDATE retex.tasks SET version = version + 1, updated_at = now(){assignments} WHERE uid = %s",
        (*[adapt(v) for v in columns.values()], uid),
    )


def move_step(cur: Cursor, uid: str, idx: int, event: StepEvent, actor: str,
              epoch: int | None, **columns: Any) -> dict[str, Any]:
    step = cur.execute(
        "SELECT * FROM retex.steps WHERE task_uid = %s AND idx = %s FOR UPDATE", (uid, idx)
    ).fetchone()
    if step is None:
        raise IllegalTransition("step", "missing", f"{event} of step {idx}")
    new_state = step_transition(step["state"], event)
    columns["state"] = str(new_state)
    assignments, values = set_clause(columns)
    updated = one(cur.execute(
        f"UPDATE retex.steps SET {assignments} WHERE task_uid = %s AND idx = %s RETURNING *",
        (*values, uid, idx),
    ))
    record_history(cur, uid, actor, f"step-{event}", epoch=epoch, step_idx=idx, from_state=step["state"],
                   to_state=str(new_state))
    touch(cur, uid)
    return updated


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
    """`col = %s, ...` and its values for an UPDATE; `NOW` becomes the database's now()."""
    assignments = ", ".join(f"{col} = now()" if val is NOW else f"{col} = %s" for col, val in columns.items())
    return assignments, [adapt(val) for val in columns.values() if val is not NOW]


def adapt(value: Any) -> Any:
    return Jsonb(value) if isinstance(value, dict | list) else value


def cancel_reason(task: dict[str, Any]) -> str:
    """What a task whose cancel was requested ends with: TaskDeleted when its Task was deleted."""
    return task["cancel_reason"] or "Cancelled"


def db_now(cur: Cursor) -> datetime:
    now: datetime = one(cur.execute("SELECT now() AS now"))["now"]
    return now


def check_result_size(result: Any) -> None:
    size = len(json.dumps(result).encode())
    if size > RESULT_LIMIT_BYTES:
        raise ResultTooLarge(f"step result is {size} bytes; the limit is {RESULT_LIMIT_BYTES} (store large data by reference)")
