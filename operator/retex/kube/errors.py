"""What the API server's answers mean, by name: the one place that reads an answer's HTTP status,
whichever client got it: the operator's (the kubernetes package's ApiException) or the worker's
(retex.kube.rest: ApiError, below). Callers ask `not_found(exc)`, `conflict(exc)`, `transient(exc)` ...
or catch the `Refused` a create's refusal is turned into; none compares status numbers.

Each predicate takes any exception (False for one that is not an answer), so it can be asked
inside a broad `except`. This module does not import the kubernetes package: a worker never does."""

from __future__ import annotations

import json
import re
import sys
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import urllib3

if TYPE_CHECKING:
    from kubernetes.client.exceptions import ApiException

# Statuses that repeating cannot fix: bad request, forbidden (admission policy, RBAC, a
# terminating namespace), not found, invalid (e.g. requests above limits). A 403 from
# ResourceQuota is the exception: quota is freed as other work ends, so it is transient.
_REFUSED_FOR_GOOD = frozenset({400, 403, 404, 422})
# The messages of the ResourceQuota admission plugin (k8s.io/apiserver's resourcequota): the
# quota is used up, or its usage not yet computed.
_QUOTA_MESSAGES = ("exceeded quota", "status unknown for quota")
# The StatusCause NamespaceLifecycle adds to its 403 (its Go field Type is "reason" in JSON).
_NAMESPACE_TERMINATING_CAUSE = "NamespaceTerminating"
# The API server's words when the authorizer (not an admission plugin) says no:
# `jobs.batch is forbidden: User "..." cannot create resource "jobs" in API group "batch" ...`.
_NOT_AUTHORIZED = re.compile(r'User ".*" cannot [a-z]+ resource "')


class ApiError(Exception):
    """A call of the worker's client (retex.kube.rest) answered with a status other than 2xx: the
    status, reason and body an ApiException carries."""

    def __init__(self, status: int, reason: str, body: str):
        super().__init__(status, reason, body)
        self.status, self.reason, self.body = status, reason, body

    def __str__(self) -> str:
        # The reason too, as an ApiException says it: "(403 Forbidden) leases ... is forbidden: ...".
        return f"({self.status} {self.reason}) {api_message(self)}"


Answer: TypeAlias = "ApiException | ApiError"


def _answer(exc: BaseException) -> Answer | None:
    """`exc` if the API server answered it. An ApiException can exist only once its module is
    imported, so a process that never imported the kubernetes package (a worker) is not made to."""
    if isinstance(exc, ApiError):
        return exc
    exceptions = sys.modules.get("kubernetes.client.exceptions")
    if exceptions is not None and isinstance(exc, exceptions.ApiException):
        return cast("ApiException", exc)
    return None


def _status(exc: BaseException) -> int | None:
    answer = _answer(exc)
    return None if answer is None else answer.status


def not_found(exc: BaseException) -> bool:
    """404: the object (or its namespace) is not there."""
    return _status(exc) == 404


def conflict(exc: BaseException) -> bool:
    """409: a create's AlreadyExists, or a write whose resourceVersion or uid precondition no longer holds."""
    return _status(exc) == 409


def expired(exc: BaseException) -> bool:
    """410: a watch's resourceVersion is too old for the API server to continue from: list again."""
    return _status(exc) == 410


def forbidden(exc: BaseException) -> bool:
    """403: the authorizer or an admission plugin said no (RBAC, a policy, a terminating
    namespace, a full ResourceQuota)."""
    return _status(exc) == 403


def invalid(exc: BaseException) -> bool:
    """422: the object is refused as it is (the schema, a CEL rule)."""
    return _status(exc) == 422


def refused_for_good(exc: BaseException) -> bool:
    """An answer that repeating the same call cannot change (400, 403, 404, 422), a full quota
    excepted."""
    status = _status(exc)
    return status in _REFUSED_FOR_GOOD and not (status == 403 and _quota_full(exc))


def transient(exc: BaseException) -> bool:
    """Whether a call's exception may clear by itself: a transport error (urllib3's, OSError), or
    an API answer that is not a refusal for good (429, 5xx, status 0: the client's wrapper when no
    response came, a quota full for now). Anything else (a refusal for good, a body the models
    refuse, a bug) fails the same way every time."""
    if _answer(exc) is not None:
        return not refused_for_good(exc)
    return isinstance(exc, urllib3.exceptions.HTTPError | OSError)


class Refused(Exception):
    """The API server refused to create an object, for good. The message is the server's own."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message, self.status = message, status


class NamespaceTerminating(Refused):
    """The namespace is being deleted: nothing new may be created in it, and its Tasks go with it."""


class NotPermitted(Refused):
    """RBAC does not let the operator create this there: the namespace was not onboarded (the
    operator's write rights come from a RoleBinding per tenant namespace)."""


def refusal(exc: Answer) -> Refused | None:
    """The `Refused` a create's ApiException means, or None when it is transient (retry it)."""
    if not refused_for_good(exc):
        return None
    message = api_message(exc)
    if forbidden(exc):
        if any(cause.get("reason") == _NAMESPACE_TERMINATING_CAUSE for cause in causes(exc)):
            return NamespaceTerminating(message, exc.status)
        if _NOT_AUTHORIZED.search(message):
            return NotPermitted(message, exc.status)
    return Refused(message, exc.status)


def raise_refusal_or_reraise(exc: Answer) -> None:
    """Inside an `except` for `exc`: raise the `Refused` it means, or `exc` itself when transient."""
    refused = refusal(exc)
    if refused is not None:
        raise refused from exc
    raise exc


def api_message(exc: Answer) -> str:
    """The message of the Status the API server answered with (falls back to the HTTP reason)."""
    return _status_of(exc).get("message") or f"{exc.status} {exc.reason}"


def causes(exc: Answer) -> list[dict[str, Any]]:
    """The StatusCauses of the answer (details.causes): which field or rule refused what."""
    found = (_status_of(exc).get("details") or {}).get("causes") or ()
    return [cause for cause in found if isinstance(cause, dict)]


def _quota_full(exc: BaseException) -> bool:
    answer = _answer(exc)
    return answer is not None and any(text in api_message(answer) for text in _QUOTA_MESSAGES)


def _status_of(exc: Answer) -> dict[str, Any]:
    try:
        status = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}
