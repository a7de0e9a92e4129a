"""The worker's ledger operations as JSON: what the operator's ledger endpoint and the worker's
client exchange. Workers hold no database credentials (docs/security.md); this module is the
one description of what they may ask for and how records and errors cross the wire.

Pure: no HTTP and no Postgres here.
"""

from __future__ import annotations

from dataclasses import fields
from datetime import datetime
from typing import Any

from retex.ledger.errors import (
    CancelRequested,
    FenceRejected,
    LedgerError,
    LedgerUnavailable,
    ResultTooLarge,
    StepOutOfOrder,
    TaskNotFound,
    UnstorableValue,
)
from retex.ledger.records import StepRecord, TaskRecord
from retex.machine import IllegalTransition, StepState, TaskPhase

# The audience of the projected ServiceAccount token a worker presents: a token minted for the
# API server (or any other audience) is refused by the endpoint.
TOKEN_AUDIENCE = "retex-ledger"
PATH_PREFIX = "/v1/attempt/"

# operation → the arguments a request carries besides the attempt's own (uid, epoch). Exactly the
# Ledger methods a worker calls: the functions of retex.ledger.worker_operations, each fenced by
# epoch inside its transaction or a read, and the reader `get`.
OPERATIONS: dict[str, tuple[str, ...]] = {
    "get": (),
    "claim_attempt": ("node",),
    "begin_step": ("idx", "request"),
    "start_run": ("idx",),
    "seconds_until_step_deadline": ("idx", "begun_at", "after_seconds"),
    "commit_step": ("idx", "result"),
    "fail_step": ("idx", "error", "retryable"),
    "flag_step": ("idx", "why"),
    "complete_task": (),
    "finish_cancelled": (),
}
# Reads take no epoch; every write's pod or actor is the authenticated pod, never the request's.
UNFENCED = frozenset({"get", "seconds_until_step_deadline"})


class RequestRefused(LedgerError):
    """The endpoint refused the caller itself (not a worker of this attempt, bad token, bad
    request): retrying cannot help."""

    def __init__(self, status: int, message: str):
        super().__init__(f"ledger endpoint refused the request ({status}): {message}")
        self.status = status


def to_json(value: Any) -> Any:
    """Records, enums and datetimes as plain JSON values."""
    if isinstance(value, (TaskRecord, StepRecord)):
        return {f.name: to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (TaskPhase, StepState)):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


_TIMES = ("not_before", "deadline_at", "created_at", "updated_at", "started_at", "finished_at")


def step_from_json(data: dict[str, Any]) -> StepRecord:
    return StepRecord(**(_known(StepRecord, data) | {"state": StepState(data["state"]),
                                                     "started_at": _time(data["started_at"]),
                                                     "finished_at": _time(data["finished_at"])}))


def task_from_json(data: dict[str, Any]) -> TaskRecord:
    return TaskRecord(**(_known(TaskRecord, data) | {name: _time(data[name]) for name in _TIMES}
                         | {"phase": TaskPhase(data["phase"]),
                            "steps": tuple(step_from_json(s) for s in data["steps"])}))


def _known(record: type, data: dict[str, Any]) -> dict[str, Any]:
    """The fields this worker knows: an endpoint newer than a Task's own worker image may send more."""
    names = {f.name for f in fields(record)}
    return {k: v for k, v in data.items() if k in names}


def time_from_json(value: str | None) -> datetime | None:
    return _time(value)


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value is not None else None


# Errors the worker branches on, with the constructor arguments that rebuild them.
_ERRORS: dict[str, tuple[type[Exception], tuple[str, ...]]] = {
    "FenceRejected": (FenceRejected, ("uid", "epoch", "current_epoch", "phase")),
    "TaskNotFound": (TaskNotFound, ("uid",)),
    "CancelRequested": (CancelRequested, ("uid",)),
    "StepOutOfOrder": (StepOutOfOrder, ()),
    "ResultTooLarge": (ResultTooLarge, ()),
    "UnstorableValue": (UnstorableValue, ()),
    "LedgerUnavailable": (LedgerUnavailable, ()),
    "IllegalTransition": (IllegalTransition, ()),
    "LedgerError": (LedgerError, ()),  # any other: the worker sees the base type and the message
}


def error_to_json(exc: Exception) -> dict[str, Any]:
    """Named by its nearest type the worker knows (a StepNotFound is an IllegalTransition to it)."""
    name = next((cls.__name__ for cls in type(exc).__mro__ if cls.__name__ in _ERRORS), "LedgerError")
    cls, attrs = _ERRORS[name]
    return {"error": name, "message": str(exc), "args": {a: getattr(exc, a) for a in attrs}}


def error_from_json(body: dict[str, Any]) -> Exception:
    """The ledger's own exception, rebuilt; an unknown name is a refusal (a newer endpoint)."""
    known = _ERRORS.get(body.get("error", ""))
    if known is None:
        return RequestRefused(500, str(body))
    cls, attrs = known
    if attrs:
        return cls(*(body["args"][a] for a in attrs))
    exc = cls.__new__(cls)
    Exception.__init__(exc, body.get("message", ""))
    if isinstance(exc, IllegalTransition):
        exc.state, exc.event = "", ""
    return exc
