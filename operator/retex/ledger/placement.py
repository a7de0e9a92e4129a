"""Placement: which tasks run, within the run limits (slots) and their concurrency keys, and the
task's phase move itself (`transition`). The two are one recursion: a task leaving a phase that
holds a slot or a key refills the free slots here, and filling a slot starts an attempt, which is
a transition. Always inside the caller's transaction."""

from __future__ import annotations

import heapq
import random
from collections import deque
from datetime import datetime, timedelta
from typing import Any

from retex.ledger.moves import NOW, db_now, record_history, set_clause
from retex.ledger.rows import (
    Cursor,
    QueuedCandidate,
    RunLimits,
    TaskRow,
    column_list,
    fetch_all,
    fetch_one,
    scalar,
)
from retex.machine import TERMINAL_PHASES, Backoff, TaskEvent, TaskPhase, task_transition

# Arbitrary but fixed: serializes placement decisions ("place" in ASCII).
PLACEMENT_LOCK_KEY = 0x706C616365
# Phases that hold a run slot (Running) or a concurrency key: leaving one may let a queued task start.
_HOLDS_KEY = (TaskPhase.RUNNING, TaskPhase.RETRYING, TaskPhase.NEEDS_ATTENTION)


def transition(cur: Cursor, task: TaskRow, event: TaskEvent, actor: str,
               detail: dict[str, Any] | None = None, **columns: Any) -> TaskRow:
    """Move the task by `event` (checked by the state machine), set `columns`, bump the version."""
    new_phase = task_transition(task.phase, event)
    columns["phase"] = str(new_phase)
    if columns.get("dead_lettered"):  # in history, so the dead-letter counter survives a requeue
        detail = {**(detail or {}), "deadLettered": True}
    if new_phase in TERMINAL_PHASES:
        columns.setdefault("finished_at", NOW)
    assignments, values = set_clause(columns)
    updated = fetch_one(
        cur, TaskRow,
        f"UPDATE retex.tasks SET {assignments}, version = version + 1, updated_at = now() "
        f"WHERE uid = %s RETURNING {column_list(TaskRow)}",
        (*values, task.uid),
    )
    if updated is None:
        raise LookupError(f"task {task.uid} is gone from under its row lock")
    record_history(cur, task.uid, actor, str(event), epoch=updated.epoch, from_state=task.phase,
                   to_state=str(new_phase), detail=detail)
    if task.phase in _HOLDS_KEY and new_phase != task.phase:
        fill_slots(cur, actor)  # a running slot or a concurrency key may have come free
    return updated


def retry_or_fail(cur: Cursor, task: TaskRow, failures: int, error: str, *, retry_reason: str,
                  actor: str, rng: random.Random | None) -> None:
    """A failed attempt, counted against the retry budget (`failures` with it): Failed and
    dead-lettered (RetriesExhausted) once it reaches max_attempts, else Retrying with
    `retry_reason` until the backoff has passed."""
    if failures >= task.max_attempts:
        transition(cur, task, TaskEvent.FAIL, actor, reason="RetriesExhausted", failures=failures,
                   dead_lettered=True, last_error=error[:4096])
    else:
        delay = Backoff(**task.backoff).delay(failures, rng)
        transition(cur, task, TaskEvent.RETRY, actor, detail={"backoffSeconds": round(delay, 3)},
                   reason=retry_reason, failures=failures, last_error=error[:4096],
                   not_before=db_now(cur) + timedelta(seconds=delay))


def start_attempt(cur: Cursor, task: TaskRow, event: TaskEvent, cause: str,
                  actor: str, **columns: Any) -> TaskRow:
    """Epoch + 1, its attempt row and its dispatch record, all in the caller's transaction."""
    epoch = task.epoch + 1
    if task.deadline_at is None and task.timeout_seconds:
        columns["deadline_at"] = db_now(cur) + timedelta(seconds=task.timeout_seconds)
    updated = transition(cur, task, event, actor, detail={"cause": cause}, epoch=epoch,
                         not_before=None, reason=None, next_cause=None,
                         started_at=task.started_at or NOW, **columns)
    cur.execute("INSERT INTO retex.attempts (task_uid, epoch, cause) VALUES (%s, %s, %s)",
                (task.uid, epoch, cause))
    # A frozen task's dispatch is held (never due) until a human recovers it (retex.ledger.witness).
    cur.execute("INSERT INTO retex.outbox (task_uid, epoch, not_before) VALUES (%s, %s, %s)",
                (task.uid, epoch, "infinity" if task.frozen_reason else None))
    return updated


def place(cur: Cursor, task: TaskRow, cause: str, actor: str) -> None:
    """A task that may run: schedule it for later, or queue it and fill the free slots (which
    starts it at once when limits, its concurrency key and the queue ahead of it allow)."""
    due = task.not_before is None or scalar(cur.execute("SELECT %s <= now()", (task.not_before,)))
    if not due:
        transition(cur, task, TaskEvent.SCHEDULE, actor)
        return
    transition(cur, task, TaskEvent.ENQUEUE, actor, next_cause=cause)
    fill_slots(cur, actor)


def fill_slots(cur: Cursor, actor: str) -> None:
    """Start Queued tasks while the run limits allow: per concurrency key only the oldest
    queued task may run, and only when no task of that key is Running, Retrying or waiting
    for a human (per-entity order).

    Among what may run, the slots are shared between namespaces: each slot goes to the
    namespace with the fewest running attempts (ties: the one whose next task was submitted
    first), so slots filled at once go round the namespaces, and a freed slot goes to the
    namespace that holds fewest. Priority, then submission, order the tasks within a namespace
    only: a namespace chooses its own priorities, and a high one must not take the slots of
    another namespace's tasks. Every namespace counts the same (no weights). A namespace stops
    getting slots at its limit: the smaller of RETEX_MAX_RUNNING_PER_NAMESPACE and its own
    (retex.namespace_run_limits, its TaskPolicy's maxRunning).

    Serialized by a transaction-scoped advisory lock, so concurrent placements never exceed
    a limit; queued rows are locked with SKIP LOCKED, so a placement never waits on a row
    while holding the lock (whoever holds that row places it when it is done). The lock is held
    to the end of the caller's transaction, every placement waiting for it meanwhile: no caller
    waits on anything outside the ledger inside one (the relay settles each dispatch record in a
    transaction of its own, after its API calls)."""
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (PLACEMENT_LOCK_KEY,))
    limits = fetch_one(cur, RunLimits, f"SELECT {column_list(RunLimits)} FROM retex.run_limits")
    if limits is None:
        raise LookupError("retex.run_limits has no row")
    own_limits: dict[str, int] = dict(cur.execute("SELECT namespace, max_running FROM retex.namespace_run_limits"))
    # An attempt the operator ended (timeout, deletion) may still be running a step until it is
    # known dead (settled): until then it keeps its slot and its key.
    unsettled = "SELECT task_uid FROM retex.attempts WHERE outcome IS NOT NULL AND settled_at IS NULL"
    # A frozen task that has not ended keeps its key: its Task showed it further on (Running,
    # perhaps), so its worker may be inside a step, and the next task of the key waits behind it.
    frozen = "SELECT uid FROM retex.tasks WHERE frozen_reason IS NOT NULL AND phase NOT IN ('Succeeded', 'Failed', 'Cancelled')"
    by_namespace: dict[str, int] = {namespace: n for namespace, n in cur.execute(
        f"""SELECT namespace, count(*) FROM retex.tasks WHERE uid IN (
                SELECT uid FROM retex.tasks WHERE phase = 'Running' UNION {unsettled})
            GROUP BY namespace""")}
    total = sum(by_namespace.values())
    busy_keys = {(namespace, key) for namespace, key in cur.execute(
        f"""SELECT DISTINCT namespace, concurrency_key FROM retex.tasks WHERE concurrency_key IS NOT NULL
            AND uid IN (SELECT uid FROM retex.tasks WHERE phase IN ('Running', 'Retrying', 'NeedsAttention')
                        UNION {unsettled}
                        UNION {frozen})""")}
    candidates = fetch_all(
        cur, QueuedCandidate,
        f"""SELECT {column_list(QueuedCandidate)} FROM (
               SELECT DISTINCT ON (namespace, concurrency_key) uid, namespace, concurrency_key, priority,
                      coalesce(submitted_at, created_at) AS submitted, created_at
               FROM retex.tasks WHERE phase = 'Queued' AND concurrency_key IS NOT NULL AND frozen_reason IS NULL
               ORDER BY namespace, concurrency_key, coalesce(submitted_at, created_at), created_at, uid
           ) AS key_heads
           UNION ALL
           SELECT uid, namespace, concurrency_key, priority, coalesce(submitted_at, created_at), created_at
           FROM retex.tasks WHERE phase = 'Queued' AND concurrency_key IS NULL AND frozen_reason IS NULL
           ORDER BY priority DESC, submitted, created_at, uid""")
    queues: dict[str, deque[QueuedCandidate]] = {}
    for candidate in candidates:  # each namespace's queue in priority, then submission, order
        queues.setdefault(candidate.namespace, deque()).append(candidate)

    def turn(namespace: str) -> tuple[int, datetime, datetime, str]:
        head = queues[namespace][0]
        return by_namespace.get(namespace, 0), head.submitted, head.created_at, head.uid

    turns = [(turn(namespace), namespace) for namespace in queues]
    heapq.heapify(turns)
    while turns:
        if limits.max_running is not None and total >= limits.max_running:
            return
        _, namespace = heapq.heappop(turns)
        caps = [n for n in (limits.max_running_per_namespace, own_limits.get(namespace)) if n is not None]
        if caps and by_namespace.get(namespace, 0) >= min(caps):
            continue  # at its limit: its other candidates wait too
        candidate = queues[namespace].popleft()
        if (namespace, candidate.concurrency_key) not in busy_keys and _started(cur, candidate, actor):
            total += 1
            by_namespace[namespace] = by_namespace.get(namespace, 0) + 1
        if queues[namespace]:
            heapq.heappush(turns, (turn(namespace), namespace))


def _started(cur: Cursor, candidate: QueuedCandidate, actor: str) -> bool:
    """Start the candidate's attempt, unless its row is locked (SKIP LOCKED: whoever holds it
    places it) or it is no longer a Queued task that may run."""
    task = fetch_one(cur, TaskRow, f"SELECT {column_list(TaskRow)} FROM retex.tasks "
                     "WHERE uid = %s AND phase = 'Queued' AND frozen_reason IS NULL FOR UPDATE SKIP LOCKED",
                     (candidate.uid,))
    if task is None:
        return False
    start_attempt(cur, task, TaskEvent.START_ATTEMPT, task.next_cause or "first", actor)
    return True


def set_run_limits(cur: Cursor, *, max_running: int | None, max_running_per_namespace: int | None) -> None:
    """Limits on running attempts, for every process that places tasks; then fill the slots
    that raised limits opened."""
    cur.execute("UPDATE retex.run_limits SET max_running = %s, max_running_per_namespace = %s",
                (max_running, max_running_per_namespace))
    fill_slots(cur, "operator")


def set_namespace_run_limit(cur: Cursor, namespace: str, max_running: int | None) -> None:
    """A namespace's own limit on running attempts (None: none, only the global ones); then fill
    the slots a raised or lifted limit opened."""
    if max_running is None:
        cur.execute("DELETE FROM retex.namespace_run_limits WHERE namespace = %s", (namespace,))
    else:
        cur.execute("INSERT INTO retex.namespace_run_limits (namespace, max_running) VALUES (%s, %s) "
                    "ON CONFLICT (namespace) DO UPDATE SET max_running = excluded.max_running", (namespace, max_running))
    fill_slots(cur, "operator")


def replace_namespace_run_limits(cur: Cursor, limits: dict[str, int]) -> None:
    """Every namespace's own limit at once: a namespace left out has none. Then fill the slots."""
    cur.execute("DELETE FROM retex.namespace_run_limits")
    cur.executemany("INSERT INTO retex.namespace_run_limits (namespace, max_running) VALUES (%s, %s)",
                    list(limits.items()))
    fill_slots(cur, "operator")
