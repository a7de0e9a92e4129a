"""Small builders shared by the ledger tests."""

import uuid
from datetime import datetime

from retex.ledger import Ledger, TaskAdmission
from retex.machine import Backoff


def admission(steps=("charge", "ship", "email"), *, namespace="shop", name=None, max_attempts=3,
              max_disruptions=10, idempotency_key=None, not_before: datetime | None = None,
              concurrency_key=None, priority=0, timeout_seconds=None,
              submitted_at: datetime | None = None) -> TaskAdmission:
    uid = str(uuid.uuid4())
    return TaskAdmission(
        uid=uid, namespace=namespace, name=name or f"order-{uid[:8]}",
        spec={"steps": [{"name": s, "exec": {"command": ["true"]}} for s in steps]},
        step_names=list(steps), max_attempts=max_attempts, max_disruptions=max_disruptions,
        backoff=Backoff(initial_seconds=0.01, max_seconds=0.05), idempotency_key=idempotency_key,
        not_before=not_before, concurrency_key=concurrency_key, priority=priority,
        timeout_seconds=timeout_seconds, submitted_at=submitted_at,
    )


def admitted(ledger: Ledger, **kwargs) -> str:
    return ledger.admit(admission(**kwargs)).uid


def run_all_steps(ledger: Ledger, uid: str, epoch: int) -> None:
    for step in ledger.get(uid).steps:
        ledger.begin_step(uid, epoch, step.idx, actor="worker")
        ledger.commit_step(uid, epoch, step.idx, {"step": step.name}, actor="worker")
