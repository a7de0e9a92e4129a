"""What every step kind is given, and how its work is bounded."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from retex.api.models import SECRET_ENV_PREFIX, SecretKeySelector
from retex.worker.drain import Drain

# Never handed to step code: the worker's plumbing, not the step's business (the token file stays
# readable by the step, which runs for the same attempt: docs/security.md); a failpoint is meant
# for the worker process only.
WORKER_ONLY_ENV = ("RETEX_LEDGER_URL", "RETEX_LEDGER_TOKEN_FILE", "RETEX_FAILPOINT")


def step_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The worker's environment minus its plumbing and every Secret value: a step gets only the
    Secret keys its own spec names (`secret_value`)."""
    return {k: v for k, v in environ.items() if k not in WORKER_ONLY_ENV and not k.startswith(SECRET_ENV_PREFIX)}


class SecretMissing(Exception):
    """The worker's container lacks a Secret key the step names: its Job was not built from this
    spec (the Job builder maps every key the spec names)."""


def secret_value(ref: SecretKeySelector, environ: Mapping[str, str] = os.environ) -> str:
    try:
        return environ[ref.env_name]
    except KeyError:
        raise SecretMissing(f"the worker has no value for Secret {ref.name} key {ref.key} (its Job maps none); "
                            "nothing was run") from None


@dataclass(frozen=True)
class StepCall:
    """What every step kind is given."""

    task_uid: str
    step: str
    idempotency_key: str
    attempt: int
    payload: dict[str, Any]
    results: dict[str, Any]  # committed results of the earlier steps, by step name
    # The run's begin on CLOCK_MONOTONIC (time.monotonic(), one clock for every process on the
    # host), read just before the fenced write that recorded it: the step's deadlines count from
    # here, so nothing after that write (spawning, interpreter start-up, imports) can stretch them.
    begun: float = field(default_factory=time.monotonic)


def _always_held() -> bool:
    return True


@dataclass(frozen=True)
class Supervision:
    """How step work is bounded: the drain, the lease (`held`: false once the worker can no longer
    show it holds it — the running step is then killed at once), and the environment of step
    processes."""

    drain: Drain
    env: Mapping[str, str] = field(default_factory=step_environment)
    kill_grace_seconds: float = 2.0
    held: Callable[[], bool] = _always_held
