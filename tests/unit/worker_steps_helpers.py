"""Builders shared by the worker's step-runner tests."""

import threading

from retex.api.models import Step
from retex.worker.calls import StepCall, Supervision, step_environment
from retex.worker.drain import Drain


def step(**fields) -> Step:
    return Step.model_validate({"name": "charge", **fields})


def call(**overrides) -> StepCall:
    fields = dict(task_uid="uid-1", step="charge", idempotency_key="uid-1:charge:abcd1234", attempt=2,
                  payload={"amount": 42}, results={"reserve": {"id": "r-1"}})
    return StepCall(**{**fields, **overrides})


def supervision(drain_seconds: float = 30.0, env: dict | None = None) -> Supervision:
    return Supervision(drain=Drain(drain_seconds), env=env if env is not None else step_environment(),
                       kill_grace_seconds=0.5)


def drain_after(sup: Supervision, seconds: float) -> threading.Timer:
    """SIGTERM arrives `seconds` from now, as the signal handler would record it."""
    timer = threading.Timer(seconds, sup.drain.begin)
    timer.start()
    return timer
