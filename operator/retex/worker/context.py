"""What a python step receives, and the two exceptions it raises to classify a failure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from retex.signalflag import SignalFlag


class PermanentError(Exception):
    """The step failed without its effect and running it again cannot help: the task fails at once."""


class RetryableError(Exception):
    """The step failed without its effect and may succeed later: the attempt ends and the task
    retries after backoff. Raise it only when nothing happened.

    Any other exception counts as retryable only for an `idempotent` step; for any other step it
    is an unknown outcome (verify, else NeedsAttention): it may have been raised after the effect.
    """


@dataclass
class StepContext:
    """The call context of a python step (and of a python verify).

    `cancelled` is set when the worker gives up on the call (its timeout, or the pod's drain
    deadline); the process is killed shortly after, so long-running code should check it. It has
    an Event's `is_set()` and `wait(timeout)`, but takes no lock: a SIGTERM handler sets it.
    """

    idempotency_key: str
    task_uid: str
    step: str
    attempt: int
    payload: dict[str, Any]
    results: dict[str, Any]
    cancelled: SignalFlag = field(default_factory=SignalFlag)
