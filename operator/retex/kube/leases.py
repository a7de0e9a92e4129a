"""The attempt Lease (coordination.k8s.io/v1): who holds it, who may take it, and the two calls.

The operator creates one Lease per task before the first Job (no holder, `leaseDurationSeconds`
set). A worker takes it for its attempt, renews it, and releases it when it stops on purpose.

- Holder identity: `"<pod name>:<epoch>"` (`holder_identity`, `parse_holder`).
- Who may take it (`judge`): nobody holds it; we already do (a restarted container of our pod);
  an older epoch holds it (the ledger has moved on, and the fence protects it: no need to wait out
  the old holder's expiry); or a pod of OUR epoch holds it and this process has watched it go
  unrenewed for the lease duration by its own clock (a duplicate pod of this attempt that died).
  A same-epoch holder seen renewing, or a newer epoch, is refused: not ours to touch.
- Release clears `holderIdentity` and records who released it in the annotation
  `retex.dev/released-by`, so the operator can tell "released by attempt N" from "never taken".

Times are compared only for change (`renewTime` as a string), never with this machine's clock:
the writer's clock and ours need not agree. The pure functions work on Lease bodies as plain
dicts, the shape the API server returns and kopf hands to the operator.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from retex.api.models import LEASE_KILL_SECONDS, default_renew_deadline_seconds
from retex.kube.errors import ApiError, conflict, not_found
from retex.kube.rest import RestClient

RELEASED_BY_ANNOTATION = "retex.dev/released-by"
_HOLDER_SEPARATOR = ":"


class LeaseNotFound(Exception):
    """The Lease does not exist (the operator creates it; a worker never does)."""


class LeaseConflict(Exception):
    """The Lease changed since it was read (HTTP 409 on resourceVersion): re-read and re-decide."""


@dataclass(frozen=True)
class LeaseTiming:
    """The worker's three numbers (client-go leader election's shape), in seconds.

    - `duration` D: the operator judges the attempt lost after D without an observed renewal.
    - `renew_deadline` R: the worker gives the lease up as lost when R has passed since the start
      of its last successful renewal, and kills its running step within `kill` K.
    - `retry_period` P = R/5: renewals are sent every P, each bounded by `request_timeout`, so a
      failing renewal is tried about five times before R.

    R + K < D: a successful renewal was written after it was sent and the operator observed it
    after that, so the step is dead before the operator's D can run out.
    """

    duration: float
    renew_deadline: float
    kill: float = LEASE_KILL_SECONDS

    @classmethod
    def of(cls, duration: float, renew_deadline: float | None = None) -> LeaseTiming:
        """The Task's renew deadline if it keeps the invariant with this duration, else the default."""
        if renew_deadline is None or renew_deadline + LEASE_KILL_SECONDS >= duration:
            renew_deadline = default_renew_deadline_seconds(duration)
        return cls(duration=duration, renew_deadline=renew_deadline)

    @property
    def retry_period(self) -> float:
        return self.renew_deadline / 5

    @property
    def request_timeout(self) -> float:
        return max(0.5, min(5.0, self.retry_period))


@dataclass(frozen=True)
class Holder:
    pod: str
    epoch: int

    @property
    def identity(self) -> str:
        return holder_identity(self.pod, self.epoch)


def holder_identity(pod: str, epoch: int) -> str:
    return f"{pod}{_HOLDER_SEPARATOR}{epoch}"


def parse_holder(identity: str | None) -> Holder | None:
    """The holder named by `identity`; None when nobody holds the Lease.

    Raises ValueError for an identity not of the form `<pod>:<epoch>` (not written by retex).
    """
    if not identity:
        return None
    pod, separator, epoch = identity.rpartition(_HOLDER_SEPARATOR)
    if not separator or not pod or not epoch.isdigit():
        raise ValueError(f"lease holder {identity!r} is not of the form <pod>:<epoch>")
    return Holder(pod=pod, epoch=int(epoch))


def format_micro_time(moment: datetime) -> str:
    """A MicroTime as the API server parses it: RFC 3339 with exactly six fractional digits.

    (`datetime.isoformat()` drops the fraction when it is zero, which the server refuses.)
    """
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseView:
    """The parts of a Lease body the protocol looks at."""

    holder_identity: str | None
    duration_seconds: int | None
    renew_time: str | None
    released_by: str | None

    @classmethod
    def of(cls, body: dict[str, Any]) -> LeaseView:
        spec = body.get("spec") or {}
        metadata = body.get("metadata") or {}
        return cls(
            holder_identity=spec.get("holderIdentity") or None,
            duration_seconds=spec.get("leaseDurationSeconds"),
            renew_time=spec.get("renewTime"),
            released_by=(metadata.get("annotations") or {}).get(RELEASED_BY_ANNOTATION),
        )


def released_by(body: dict[str, Any]) -> Holder | None:
    """The holder that released this Lease, if nobody holds it now and a retex worker released it."""
    view = LeaseView.of(body)
    if view.holder_identity is not None:
        return None
    try:
        return parse_holder(view.released_by)
    except ValueError:
        return None


class RenewalWatch:
    """What this process has seen of a Lease's renewals, by its own monotonic clock.

    A holder counts as renewing when its `renewTime` changes between two of our reads; it counts
    as silent for as long as we have seen the same (holder, renewTime).
    """

    def __init__(self) -> None:
        self._seen: tuple[str | None, str | None] | None = None
        self._since = 0.0
        self.renewals_seen = 0

    def observe(self, view: LeaseView, now: float) -> None:
        seen = (view.holder_identity, view.renew_time)
        if seen == self._seen:
            return
        if self._seen is not None and self._seen[0] == view.holder_identity:
            self.renewals_seen += 1
        else:
            self.renewals_seen = 0  # a different holder: start watching it afresh
        self._seen, self._since = seen, now

    def silent_for(self, now: float) -> float:
        return now - self._since


class Verdict(enum.StrEnum):
    TAKE = "take"
    WAIT = "wait"  # a same-epoch holder not yet seen renewing nor silent for the duration: read again
    REFUSE = "refuse"  # a live holder of our epoch, a newer epoch, or a holder retex did not write


def judge(view: LeaseView, me: Holder, watch: RenewalWatch, now: float, *, default_duration: float) -> Verdict:
    """May `me` take the Lease? `watch` must have observed `view` already."""
    if view.holder_identity is None or view.holder_identity == me.identity:
        return Verdict.TAKE
    try:
        holder = parse_holder(view.holder_identity)
    except ValueError:
        return Verdict.REFUSE
    if holder is None or holder.epoch < me.epoch:  # None: an empty holderIdentity, nobody holds it
        return Verdict.TAKE
    if holder.epoch > me.epoch or watch.renewals_seen > 0:
        return Verdict.REFUSE
    duration = view.duration_seconds or default_duration
    return Verdict.TAKE if watch.silent_for(now) >= duration else Verdict.WAIT


# --- bodies -----------------------------------------------------------------------------------


def acquired(body: dict[str, Any], me: Holder, duration_seconds: int, now: datetime) -> dict[str, Any]:
    """`body` taken by `me` (or re-taken: then acquireTime and the transition count stay)."""
    new = copy.deepcopy(body)
    spec = new.setdefault("spec", {})
    if spec.get("holderIdentity") != me.identity:
        spec["acquireTime"] = format_micro_time(now)
        spec["leaseTransitions"] = (spec.get("leaseTransitions") or 0) + 1
    spec["holderIdentity"] = me.identity
    spec["leaseDurationSeconds"] = duration_seconds
    spec["renewTime"] = format_micro_time(now)
    (new.get("metadata", {}).get("annotations") or {}).pop(RELEASED_BY_ANNOTATION, None)
    return new


def renewed(body: dict[str, Any], now: datetime) -> dict[str, Any]:
    new = copy.deepcopy(body)
    new["spec"]["renewTime"] = format_micro_time(now)
    return new


def released(body: dict[str, Any], now: datetime) -> dict[str, Any]:
    """No holder, and a note of who let go. acquireTime and leaseTransitions are history: kept."""
    new = copy.deepcopy(body)
    spec = new["spec"]
    identity = spec.pop("holderIdentity", None)
    spec["renewTime"] = format_micro_time(now)
    metadata = new.setdefault("metadata", {})
    if identity:
        metadata.setdefault("annotations", {})
        metadata["annotations"] = {**(metadata["annotations"] or {}), RELEASED_BY_ANNOTATION: identity}
    return new


# --- calls ------------------------------------------------------------------------------------


_LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"


def read_lease(api: RestClient, namespace: str, name: str, *, timeout: float) -> dict[str, Any]:
    """GET the Lease as a plain dict. Raises LeaseNotFound, or ApiError / urllib3 errors."""
    return _call(api, "GET", namespace, name, None, timeout)


def replace_lease(api: RestClient, namespace: str, name: str, body: dict[str, Any], *,
                  timeout: float) -> dict[str, Any]:
    """PUT `body`; its metadata.resourceVersion makes it conditional. Raises LeaseConflict on 409."""
    return _call(api, "PUT", namespace, name, body, timeout)


def _call(api: RestClient, method: str, namespace: str, name: str, body: dict[str, Any] | None,
          timeout: float) -> dict[str, Any]:
    # Raw JSON both ways: MicroTime strings are sent back exactly as they were read.
    try:
        return api.call(method, _LEASE_PATH.format(namespace=namespace, name=name), body, timeout=timeout)
    except ApiError as refused:
        if not_found(refused):
            raise LeaseNotFound(f"lease {namespace}/{name} not found") from refused
        if conflict(refused):
            raise LeaseConflict(f"lease {namespace}/{name} changed since it was read") from refused
        raise
