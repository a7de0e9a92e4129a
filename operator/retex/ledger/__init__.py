"""The Postgres step ledger: the one source of truth of retex. Knows nothing of Kubernetes.

Public surface: `Ledger` (operations), the records it returns, and its typed errors.

`Ledger` and `NOTIFY_CHANNEL` are imported on first use: the store and its readers bring psycopg,
which the worker (it reaches the ledger over HTTP) would otherwise load in every pod for nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from retex.ledger.errors import (
    CancelRequested,
    FenceRejected,
    InstallMismatch,
    LedgerError,
    LedgerUnavailable,
    NotFrozen,
    NotLeader,
    ResultTooLarge,
    StepInFlight,
    StepNotFound,
    StepOutOfOrder,
    TaskNotFound,
    UnstorableValue,
)
from retex.ledger.hashing import spec_hash, step_idempotency_key
from retex.ledger.records import (
    DURATION_BUCKETS,
    RESULT_LIMIT_BYTES,
    AdmitResult,
    AttemptRecord,
    Dispatch,
    Histogram,
    HistoryEntry,
    LedgerFigures,
    NamespaceQuota,
    NamespaceUsage,
    QuotaUse,
    Refusal,
    StepRecord,
    TaskAdmission,
    TaskRecord,
    TaskRef,
    WatchedAttempt,
)

__all__ = [
    "NOTIFY_CHANNEL", "RESULT_LIMIT_BYTES", "AdmitResult", "AttemptRecord", "CancelRequested", "Dispatch",
    "DispatchOutcomes",
    "FenceRejected", "Histogram", "HistoryEntry", "DURATION_BUCKETS", "InstallMismatch", "LedgerFigures", "Ledger",
    "LedgerError", "LedgerUnavailable", "NamespaceQuota", "NamespaceUsage", "NotFrozen", "NotLeader", "QuotaUse",
    "Refusal", "ResultTooLarge",
    "SessionLimits", "StepInFlight", "StepNotFound", "StepOutOfOrder", "StepRecord", "TaskAdmission", "TaskNotFound",
    "TaskRecord", "TaskRef", "UnstorableValue", "WatchedAttempt",
    "spec_hash", "step_idempotency_key",
]

_ON_FIRST_USE = {"Ledger": "retex.ledger.store", "SessionLimits": "retex.ledger.transactions",
                 "DispatchOutcomes": "retex.ledger.outbox",
                 "NOTIFY_CHANNEL": "retex.ledger.readers"}

if TYPE_CHECKING:
    from retex.ledger.outbox import DispatchOutcomes
    from retex.ledger.readers import NOTIFY_CHANNEL
    from retex.ledger.store import Ledger
    from retex.ledger.transactions import SessionLimits


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        return getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
