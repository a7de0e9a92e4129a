"""What a python step receives, and the two exceptions it raises to classify a failure."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


class PermanentError(Exception):
    """The step failed and running it again cannot help: the task fails at once."""


class RetryableError(Exception):
    """The step failed and may succeed later: the attempt ends and the task retries after backoff.

    Any other exception raised by a step counts as retryable too.
    """


@dataclass
class StepContext:
    """The call context of a python step (and of a python verify).

    `cancelled` is set when the worker gives up on the call (its timeout, or the pod's drain
    deadline); the process is killed shortly after, so long-running code should check it.
    """

    idempotency_key: str
    task_uid: str
    step: str
    attempt: int
    payload: dict[str, Any]
    results: dict[str, Any]
    cancelled: threading.Event = field(default_factory=threading.Event)
