"""The Postgres step ledger: the one source of truth of retex. Knows nothing of Kubernetes.

Public surface: `Ledger` (operations), the records it returns, and its typed errors.
"""

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
from retex.ledger.operator_operations import spec_hash, step_idempotency_key
from retex.ledger.readers import NOTIFY_CHANNEL
from retex.ledger.records import (
    DURATION_BUCKETS,
    RESULT_LIMIT_BYTES,
    AdmitResult,
    AttemptRecord,
    Dispatch,
    Histogram,
    HistoryEntry,
    LedgerFigures,
    Refusal,
    StepRecord,
    TaskAdmission,
    TaskRecord,
    TaskRef,
    WatchedAttempt,
)
from retex.ledger.store import Ledger

__all__ = [
    "NOTIFY_CHANNEL", "RESULT_LIMIT_BYTES", "AdmitResult", "AttemptRecord", "CancelRequested", "Dispatch",
    "FenceRejected", "Histogram", "HistoryEntry", "DURATION_BUCKETS", "LedgerFigures", "Ledger", "LedgerError",
    "LedgerUnavailable", "Refusal", "ResultTooLarge",
    "StepOutOfOrder", "StepRecord", "TaskAdmission", "TaskNotFound", "TaskRecord", "TaskRef", "UnstorableValue",
    "WatchedAttempt",
    "spec_hash", "step_idempotency_key",
]
