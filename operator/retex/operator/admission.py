"""From a Task object to what the ledger admits. Pure."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ValidationError

from retex.api import TaskSpec
from retex.api.models import (
    ANNOTATIONS_MAX_BYTES,
    MSG_ANNOTATIONS_TOO_LARGE,
    OPERATOR_ANNOTATIONS_RESERVE_BYTES,
    annotations_bytes,
)
from retex.ledger import QuotaUse, TaskAdmission
from retex.machine import Backoff


def admission_for(*, uid: str, namespace: str, name: str, spec: dict[str, Any],
                  submitted_at: datetime | None = None) -> TaskAdmission:
    """Validates the spec with the models (the CRD already did; this also enforces the payload
    size the API server cannot measure) and maps it onto the ledger's terms."""
    parsed = TaskSpec.model_validate(spec)
    backoff = parsed.retry.backoff
    return TaskAdmission(
        uid=uid,
        namespace=namespace,
        name=name,
        spec=parsed.as_admitted(),
        step_names=[step.name for step in parsed.steps],
        max_attempts=parsed.retry.max_attempts,
        max_disruptions=parsed.retry.max_disruptions,
        backoff=Backoff(initial_seconds=backoff.initial_seconds, max_seconds=backoff.max_seconds,
                        factor=backoff.factor, full_jitter=parsed.retry.jitter == "Full"),
        idempotency_key=parsed.idempotency_key,
        not_before=parsed.not_before,
        concurrency_key=parsed.concurrency_key,
        priority=parsed.priority,
        timeout_seconds=parsed.timeout_seconds,
        submitted_at=submitted_at,
    )


def invalid_spec_message(error: ValidationError) -> str:
    """The InvalidSpec refusal's message: every problem as `<field path>: <what is wrong>`, the
    path as the API server writes it (`spec.steps[0].name`). Not pydantic's own text: it repeats
    the input (a 64 KiB payload, in a Task's status) and links to pydantic's site."""
    problems = []
    for problem in error.errors(include_url=False, include_input=False):
        path = "spec" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in problem["loc"])
        cause = (problem.get("ctx") or {}).get("error")  # a rule of ours: its message as written
        problems.append(f"{path}: {cause if isinstance(cause, Exception) else problem['msg']}")
    return "; ".join(problems)


def annotations_refusal(annotations: dict[str, str] | None, *, own_prefix: str) -> str | None:
    """Why the Task's annotations leave too little room for the operator's own, or None.

    Every patch of the operator's (kopf's progress records, its diff base, the finalizer) is
    checked by the API server against the limit on all annotations together; a Task already
    close to it (kubectl apply's last-applied copy of a large payload) could never be patched,
    so never finished nor deleted. The operator's own annotations (under `own_prefix`) are not
    counted: they are replaced, not added."""
    theirs = {k: v for k, v in (annotations or {}).items() if not k.startswith(f"{own_prefix}/")}
    size, room = annotations_bytes(theirs), ANNOTATIONS_MAX_BYTES - OPERATOR_ANNOTATIONS_RESERVE_BYTES
    return MSG_ANNOTATIONS_TOO_LARGE.format(size=size, room=room) if size > room else None


NAMESPACE_NOT_ONBOARDED = "NamespaceNotOnboarded"


def not_onboarded_message(namespace: str, server_message: str) -> str:
    """Why a Task of a namespace nobody onboarded never runs, and what to do about it."""
    return (f"namespace {namespace} is not onboarded for retex: the operator may not create Jobs, Leases or "
            f"Events there (no RoleBinding retex-operator to the ClusterRole retex-operator-tenant in "
            f"{namespace}). An administrator onboards it with `kubectl apply -n {namespace} -k manifests/tenant` "
            f"(docs/install.md); then create the Task again. The API server said: {server_message}")


QUOTA_EXCEEDED = "QuotaExceeded"
_QUOTAS = {"tasks": ("tasks", "RETEX_NAMESPACE_MAX_TASKS"),
           "resultBytes": ("bytes of step results", "RETEX_NAMESPACE_MAX_RESULT_BYTES")}


def quota_message(over: QuotaUse, *, retention_days: float | None) -> str:
    """Why a Task of a namespace at its ledger quota is not run, and what frees room."""
    what, setting = _QUOTAS[over.resource]
    leaving = (f"a finished task leaves the ledger {retention_days:g} days after it ended (history retention), "
               "whether or not its Task was deleted" if retention_days else
               "history retention is off, so finished tasks stay until an administrator purges them")
    return (f"namespace {over.namespace} keeps {over.used} {what} in the ledger, at or over its limit of {over.limit} "
            f"(the operator's {setting}); every task of the namespace counts, whatever its phase, until it is "
            f"purged: {leaving}. Cancel or delete the unfinished Tasks you do not need, or ask the operator's "
            "administrator to raise the limit. This Task is never run: create it again once there is room")
