"""The rows the ledger's statements read, typed. A statement that reads named columns selects
exactly the fields of a frozen dataclass (`column_list(TaskRow)`) and gets instances of it
(psycopg's `class_row`), so a column read is checked by mypy and a renamed or missing column
fails at the first read, not as a KeyError deep in an operation. Every other statement (a
count, a single value) reads a plain tuple: `scalar`.

The row types here are the tables' own (and the few joins the operations read); what callers
outside the ledger get are the records of retex.ledger.records, built from these rows."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from psycopg.abc import Params
from psycopg.rows import TupleRow, class_row

# The cursor every operation takes: tuple rows (psycopg's default, as the pool's connections hand
# out; a dict-row cursor would break every `scalar` and tuple unpacking); named rows are read
# through `fetch_one` / `fetch_all`.
Cursor = psycopg.Cursor[TupleRow]
R = TypeVar("R")


def column_list(row: type[Any], alias: str | None = None) -> str:
    """The explicit column list of a row type, its fields in order (`t.uid, t.namespace, ...`
    with an `alias`)."""
    prefix = f"{alias}." if alias else ""
    return ", ".join(prefix + f.name for f in fields(row))


def fetch_one(cur: Cursor, row: type[R], query: str, params: Params | None = None) -> R | None:
    """The first row of `query` as a `row`, or None. Runs in the cursor's transaction."""
    with cur.connection.cursor(row_factory=class_row(row)) as typed:
        return typed.execute(query, params).fetchone()


def fetch_all(cur: Cursor, row: type[R], query: str, params: Params | None = None) -> list[R]:
    """Every row of `query` as `row`s. Runs in the cursor's transaction."""
    with cur.connection.cursor(row_factory=class_row(row)) as typed:
        return typed.execute(query, params).fetchall()


def one(cur: Cursor) -> TupleRow:
    """The row of a statement that always returns one (an aggregate, RETURNING of a locked row)."""
    row = cur.fetchone()
    if row is None:
        raise LookupError("the statement returned no row")
    return row


def scalar(cur: Cursor) -> Any:
    """The single value of a statement that always returns one row of one column."""
    return one(cur)[0]


@dataclass(frozen=True)
class TaskRow:
    """A row of retex.tasks."""

    uid: str
    namespace: str
    name: str
    spec: dict[str, Any]
    spec_hash: str
    idempotency_key: str | None
    phase: str
    reason: str | None
    dead_lettered: bool
    epoch: int
    failures: int
    disruptions: int
    max_attempts: int
    max_disruptions: int
    backoff: dict[str, Any]  # machine.Backoff's fields
    not_before: datetime | None
    cancel_requested: bool
    last_error: str | None
    version: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    concurrency_key: str | None
    priority: int
    timeout_seconds: int | None
    deadline_at: datetime | None
    next_cause: str | None  # of a Queued task: the cause its attempt will start with
    submitted_at: datetime | None
    cancel_reason: str | None
    frozen_reason: str | None  # LedgerBehind or LedgerLost: its Task showed more than the ledger held
    witness: dict[str, Any] | None  # the Task's status when it was frozen


@dataclass(frozen=True)
class StepRow:
    """A row of retex.steps."""

    task_uid: str
    idx: int
    name: str
    state: str
    attempt: int | None
    idempotency_key: str
    result: Any
    error: str | None
    started_at: datetime | None
    finished_at: datetime | None
    begin_request: str | None  # the begin_step call that moved it last, and what it was before that call
    prior_state: str | None
    prior_attempt: int | None
    prior_started_at: datetime | None


@dataclass(frozen=True)
class StepToBegin(StepRow):
    """A step row `begin_step` reads, with how many steps ahead of it are not done."""

    undone_ahead: int


@dataclass(frozen=True)
class StepLock:
    """What `lock_step` reads of a step it locks."""

    state: str
    name: str


@dataclass(frozen=True)
class RunLimits:
    """The row of retex.run_limits; None: unlimited."""

    max_running: int | None
    max_running_per_namespace: int | None


@dataclass(frozen=True)
class QueuedCandidate:
    """A Queued task that placement may start, in the order it considers them."""

    uid: str
    namespace: str
    concurrency_key: str | None
    priority: int
    submitted: datetime
    created_at: datetime


@dataclass(frozen=True)
class ClaimedRecord:
    """An unsent outbox record the relay claimed, with what its Job is built from."""

    id: int
    task_uid: str
    epoch: int
    attempts: int  # deferrals so far
    namespace: str
    name: str
    spec: dict[str, Any]
    deadline_at: datetime | None
    deferred_seconds: float | None
    cancel_requested: bool
    cancel_reason: str | None
    current: bool  # its epoch is the task's and the task is Running
