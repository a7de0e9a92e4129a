"""Who is calling the ledger endpoint: a bearer token → the worker pod it was minted for.

A worker proves itself with its projected ServiceAccount token, bound to its pod and minted for
the `retex-ledger` audience. The API server's TokenReview says whether the token is valid, for
that audience, and which pod it is bound to (a bound token stops validating when its pod is
deleted). The pod's labels and controlling Job then say which task and epoch it claims; the
endpoint checks that claim against the ledger (retex.operator.ledger_endpoint).

Reviews are cached briefly by the token's hash: a step makes several ledger calls, and the epoch
fence, not the token's freshness, is what refuses a stale worker (so a deleted pod's token may act
for up to a minute more, fenced as any late write) — but never past the token's own expiry (its
`exp` claim, read once the API server has accepted the token). Refusals are cached too, for less,
so a caller repeating a bad token costs the API server one review per ten seconds, and apart from
the verdicts that admit a pod: a flood of refusals never evicts a live worker's verdict. A string
that is no JWT naming the `retex-ledger` audience is refused without a review (the API server
would refuse it too): random strings cost the API server nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import TypeVar

from kubernetes import client

from retex.kube.objects import LABEL_EPOCH, LABEL_TASK_UID
from retex.ledger.wire import TOKEN_AUDIENCE

_POD_NAME = "authentication.kubernetes.io/pod-name"
_POD_UID = "authentication.kubernetes.io/pod-uid"
_SA_PREFIX = "system:serviceaccount:"
REQUEST_TIMEOUT = 10
CACHE_SECONDS = 60.0
REFUSAL_CACHE_SECONDS = 10.0  # a token refused once is refused again without asking the API server
_CACHE_LIMIT = 4096  # verdicts of each kind (admitted, refused) kept at most


class NotAWorker(Exception):
    """The token does not identify a worker pod of some attempt; the message says why."""


class IdentityUnavailable(Exception):
    """The API server could not be asked: the caller should retry."""


@dataclass(frozen=True)
class WorkerIdentity:
    namespace: str
    pod: str
    service_account: str
    job_name: str  # the pod's controlling Job
    task_uid: str  # from the pod's labels, which the Job's template set
    epoch: int


def identity_of(namespace: str, service_account: str, pod: client.V1Pod) -> WorkerIdentity:
    """The attempt a pod says it runs, from its labels and controlling Job. Pure."""
    meta = pod.metadata or client.V1ObjectMeta()
    labels = meta.labels or {}
    owner = next((o for o in meta.owner_references or [] if o.controller), None)
    if not meta.name or owner is None or owner.kind != "Job":
        raise NotAWorker(f"pod {namespace}/{meta.name} is not controlled by a Job")
    try:
        epoch = int(labels[LABEL_EPOCH])
        uid = labels[LABEL_TASK_UID]
    except (KeyError, ValueError):
        raise NotAWorker(f"pod {namespace}/{meta.name} has no retex task and epoch labels") from None
    return WorkerIdentity(namespace=namespace, pod=meta.name, service_account=service_account,
                          job_name=owner.name, task_uid=uid, epoch=epoch)


class WorkerIdentities:
    """Token → WorkerIdentity, through TokenReview and one pod read."""

    def __init__(self, api: client.ApiClient, *, cache_seconds: float = CACHE_SECONDS):
        self._auth = client.AuthenticationV1Api(api)
        self._core = client.CoreV1Api(api)
        self._cache_seconds = cache_seconds
        # token hash → (monotonic expiry, verdict); insertion order is age order.
        self._admitted: dict[str, tuple[float, WorkerIdentity]] = {}
        self._refused: dict[str, tuple[float, NotAWorker]] = {}
        self._lock = threading.Lock()

    def cached(self, token: str) -> WorkerIdentity | None:
        """The verdict on `token` without asking the API server: the identity, NotAWorker raised,
        or None when only a review can tell."""
        key, now = _key(token), time.monotonic()
        with self._lock:
            admitted, refused = self._admitted.get(key), self._refused.get(key)
        if admitted and admitted[0] > now:
            return admitted[1]
        if refused and refused[0] > now:
            raise refused[1]
        if not _names_the_audience(token):
            raise NotAWorker(f"token not accepted for audience {TOKEN_AUDIENCE}: no JWT naming it")
        return None

    def resolve(self, token: str) -> WorkerIdentity:
        found = self.cached(token)
        if found is not None:
            return found
        key = _key(token)
        try:
            identity = self._review(token)
        except NotAWorker as refused:
            with self._lock:
                _keep(self._refused, key, (time.monotonic() + REFUSAL_CACHE_SECONDS, refused))
            raise
        seconds = min(self._cache_seconds, _seconds_to_expiry(token, default=self._cache_seconds))
        with self._lock:
            _keep(self._admitted, key, (time.monotonic() + seconds, identity))
        return identity

    def _review(self, token: str) -> WorkerIdentity:
        """The pod the API server says the token is bound to; NotAWorker if it is no worker's."""
        review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[TOKEN_AUDIENCE]))
        try:
            status = self._auth.create_token_review(review, _request_timeout=REQUEST_TIMEOUT).status
        except client.ApiException as exc:
            raise IdentityUnavailable(f"TokenReview failed: {exc.status} {exc.reason}") from exc
        except Exception as exc:  # transport errors: urllib3's, OSError
            raise IdentityUnavailable(f"TokenReview failed: {exc}") from exc
        if status is None or not status.authenticated:
            raise NotAWorker(f"token not accepted for audience {TOKEN_AUDIENCE}: "
                             f"{(status and status.error) or 'unauthenticated'}")
        if TOKEN_AUDIENCE not in (status.audiences or []):
            raise NotAWorker(f"token is not for audience {TOKEN_AUDIENCE}")
        user = status.user or client.V1UserInfo()
        username = user.username or ""
        extra = user.extra or {}
        if not username.startswith(_SA_PREFIX) or not extra.get(_POD_NAME) or not extra.get(_POD_UID):
            raise NotAWorker(f"{username or 'the caller'} is not a pod-bound ServiceAccount token")
        namespace, _, service_account = username[len(_SA_PREFIX):].partition(":")
        pod_name, pod_uid = extra[_POD_NAME][0], extra[_POD_UID][0]
        try:
            pods = self._core.list_namespaced_pod(namespace, field_selector=f"metadata.name={pod_name}",
                                                  _request_timeout=REQUEST_TIMEOUT).items
        except client.ApiException as exc:
            raise IdentityUnavailable(f"reading pod {namespace}/{pod_name} failed: {exc.status} {exc.reason}") from exc
        except Exception as exc:
            raise IdentityUnavailable(f"reading pod {namespace}/{pod_name} failed: {exc}") from exc
        pod = next((p for p in pods if p.metadata and p.metadata.uid == pod_uid), None)
        if pod is None:
            raise NotAWorker(f"pod {namespace}/{pod_name} (uid {pod_uid}) no longer exists")
        return identity_of(namespace, service_account, pod)


_Verdict = TypeVar("_Verdict", WorkerIdentity, NotAWorker)


def _key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _keep(cache: dict[str, tuple[float, _Verdict]], key: str, entry: tuple[float, _Verdict]) -> None:
    """Store `entry`; a full cache drops its expired entries, then its oldest."""
    cache.pop(key, None)
    if len(cache) >= _CACHE_LIMIT:
        now = time.monotonic()
        for stale in [k for k, (expiry, _) in cache.items() if expiry <= now] or [next(iter(cache))]:
            del cache[stale]
    cache[key] = entry


def _claims(token: str) -> dict[str, object]:
    """A JWT's claims, unverified (only the API server's review verifies them)."""
    try:
        part = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (IndexError, ValueError, TypeError):
        return {}
    return claims if isinstance(claims, dict) else {}


def _names_the_audience(token: str) -> bool:
    """Whether the token could be a projected token for the endpoint: a JWT whose `aud` names it.
    Every token the API server would accept for the audience does."""
    audience = _claims(token).get("aud")
    return audience == TOKEN_AUDIENCE or isinstance(audience, list) and TOKEN_AUDIENCE in audience


def _seconds_to_expiry(token: str, *, default: float) -> float:
    """Seconds until the `exp` claim of a JWT the API server has just accepted (so its signature
    and its claims are the API server's, not the caller's say); `default` if it has none."""
    exp = _claims(token).get("exp")
    try:
        return float(exp) - time.time() if isinstance(exp, (int, float, str)) else default
    except ValueError:
        return default
