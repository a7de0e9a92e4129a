"""Leader election among operator replicas on one coordination.k8s.io Lease, in client-go's shape.

Three numbers (`ElectionTiming`): the lease duration D, the renew deadline R and the retry period
P, with D > R > P. Every P a replica reads the Lease and, as `Election.decide` says, creates it,
renews it (it holds it), takes it (free, or unchanged for D by its own clock), or waits (someone
else renewed it less than D ago); a leader whose last read or write named itself renews without
reading first (client-go's fast path: the write is conditional on the Lease being as it last
wrote it), and its calls may take until its renew deadline (`Election.call_timeout`). The leader
counts as leading until R after the *start* of its last successful write (`Election.leading`),
so it stops writing before anyone can take over: a standby takes over only D after it *saw* the
last renewal (a read is dated when its answer came), and it saw it after the write began. A
leader that reads another holder stops leading at once.
Clocks are never compared across machines: renewTime is only compared for change, times are
each replica's monotonic clock.

`Election` is pure (clock passed in, bodies as dicts); `LeaderLease` holds the two API calls.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from retex.kube.errors import conflict, not_found
from retex.kube.leases import LeaseConflict, format_micro_time

LEADER_LEASE_NAME = "retex-operator-leader"


@dataclass(frozen=True)
class ElectionTiming:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        # client-go's checks (leaderelection.NewLeaderElector), JitterFactor 1.2 included.
        if min(self.lease_duration, self.renew_deadline, self.retry_period) <= 0:
            raise ValueError("leader election: every duration must be positive")
        if self.lease_duration <= self.renew_deadline:
            raise ValueError(f"leader election: the lease duration ({self.lease_duration} s) must be "
                             f"greater than the renew deadline ({self.renew_deadline} s)")
        if self.renew_deadline <= 1.2 * self.retry_period:
            raise ValueError(f"leader election: the renew deadline ({self.renew_deadline} s) must be "
                             f"greater than 1.2 × the retry period ({self.retry_period} s)")

    @property
    def request_timeout(self) -> float:
        """The timeout of every API call the leader makes: D − R. A call sent while leading (before
        the renew deadline R) has had its answer, or been given up, by the lease duration D, when
        a successor may start. (The API server may still apply a request it received in time.)"""
        return self.lease_duration - self.renew_deadline



@dataclass(frozen=True)
class LeaderRecord:
    """The Lease's spec as the election reads and writes it."""

    holder: str | None
    duration_seconds: int
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0

    @classmethod
    def of(cls, lease: dict[str, Any]) -> LeaderRecord:
        spec = lease.get("spec") or {}
        return cls(holder=spec.get("holderIdentity") or None,
                   duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
                   acquire_time=spec.get("acquireTime"), renew_time=spec.get("renewTime"),
                   transitions=int(spec.get("leaseTransitions") or 0))

    def spec(self) -> dict[str, Any]:
        return {"holderIdentity": self.holder, "leaseDurationSeconds": self.duration_seconds,
                "acquireTime": self.acquire_time, "renewTime": self.renew_time,
                "leaseTransitions": self.transitions}


class Decision(enum.StrEnum):
    CREATE = "create"  # no Lease yet
    RENEW = "renew"  # we hold it
    TAKE = "take"  # free, released, or its holder silent for its duration
    WAIT = "wait"  # another replica holds it and renewed it less than its duration ago


class Election:
    """One replica's view of the election. Feed it every read (`observe`) and every successful
    write (`won`); ask it what to do next (`decide`, `record`) and whether it may write (`leading`)."""

    def __init__(self, identity: str, timing: ElectionTiming):
        self.identity, self.timing = identity, timing
        self.observed: LeaderRecord | None = None
        self._observed_at: float | None = None  # our clock when `observed` last changed
        self._renewed_at: float | None = None  # our clock at the start of our last successful write

    def observe(self, record: LeaderRecord | None, now: float) -> None:
        """What a read returned (None: no Lease). An unchanged record keeps its observation time."""
        if record != self.observed or self._observed_at is None:
            self.observed, self._observed_at = record, now

    def observed_holder_is_another(self) -> bool:
        """The Lease as last read or written names another replica (or nobody)."""
        return self.observed is not None and self.observed.holder != self.identity

    def decide(self, now: float) -> Decision:
        if self.observed is None:
            return Decision.CREATE
        holder = self.observed.holder
        if holder == self.identity:
            return Decision.RENEW
        duration = self.observed.duration_seconds or self.timing.lease_duration
        if holder is None or (self._observed_at is not None and now >= self._observed_at + duration):
            return Decision.TAKE
        return Decision.WAIT

    def record(self, decision: Decision, wall: datetime) -> LeaderRecord:
        """The record to write for `decision` (not WAIT): us as holder, renewed now."""
        now = format_micro_time(wall)
        previous = self.observed
        duration = math.ceil(self.timing.lease_duration)  # whole seconds; never below ours
        if decision is Decision.RENEW and previous is not None:
            return LeaderRecord(holder=self.identity, duration_seconds=duration,
                                acquire_time=previous.acquire_time or now, renew_time=now,
                                transitions=previous.transitions)
        transitions = previous.transitions + 1 if previous is not None else 0  # a new leader
        return LeaderRecord(holder=self.identity, duration_seconds=duration, acquire_time=now,
                            renew_time=now, transitions=transitions)

    def won(self, record: LeaderRecord, started_at: float) -> None:
        """A write that began at `started_at` (our clock) succeeded."""
        self.observed, self._observed_at = record, started_at
        self._renewed_at = started_at

    def released(self, record: LeaderRecord, now: float) -> None:
        """We gave the Lease up on purpose (`released_record` was written)."""
        self.observed, self._observed_at = record, now
        self._renewed_at = None

    def stop_leading(self) -> None:
        """Not leading from now on, though the Lease may still be ours: the next write of it, if
        it succeeds, is a new leadership (`leading` at its start said no)."""
        self._renewed_at = None

    def call_timeout(self, now: float) -> float:
        """How long the election's next call may take. A leader's: until its renew deadline, as
        client-go's renew context (on an API server slow to answer, a renewal answered late still
        keeps the leadership that a shorter timeout would end, though every call was answered).
        Anyone else's: the bound of every operator call, D − R. Either is over by the lease
        duration after the last renewal, when a successor may start."""
        if self._renewed_at is not None:
            left = self._renewed_at + self.timing.renew_deadline - now
            if left > 0:
                return left
        return self.timing.request_timeout

    def leading(self, now: float) -> bool:
        """Whether this replica may still write: its last successful write began less than the
        renew deadline ago. False from the deadline on, whether or not anyone else took over."""
        return self._renewed_at is not None and now < self._renewed_at + self.timing.renew_deadline

    def released_record(self, wall: datetime) -> LeaderRecord:
        """What a leader that stops on purpose writes: no holder, so a standby takes over at its
        next retry instead of after the lease duration (client-go's ReleaseOnCancel)."""
        previous = self.observed or LeaderRecord(holder=None, duration_seconds=1)
        return LeaderRecord(holder=None, duration_seconds=1, acquire_time=previous.acquire_time,
                            renew_time=format_micro_time(wall), transitions=previous.transitions)


class LeaderLease:
    """The election Lease's calls, each bounded by the timeout it is given (`Election.call_timeout`).
    Conflicts (someone else wrote first) raise `LeaseConflict`."""

    def __init__(self, api: client.ApiClient, namespace: str, *, name: str = LEADER_LEASE_NAME):
        self._coordination = client.CoordinationV1Api(api)
        self.namespace, self.name = namespace, name
        self._version: str | None = None  # resourceVersion of the last read or write

    def read(self, *, timeout: float) -> LeaderRecord | None:
        try:
            lease = self._coordination.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as exc:
            if not_found(exc):
                self._version = None
                return None
            raise
        plain = self._coordination.api_client.sanitize_for_serialization(lease)
        self._version = plain["metadata"]["resourceVersion"]
        return LeaderRecord.of(plain)

    def write(self, record: LeaderRecord, *, timeout: float) -> None:
        """Create the Lease (none was read) or replace the one read or written last, if it has not changed."""
        body: dict[str, Any] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                "metadata": {"name": self.name, "namespace": self.namespace},
                                "spec": record.spec()}
        try:
            if self._version is None:
                written = self._coordination.create_namespaced_lease(self.namespace, body,  # type: ignore[arg-type]  # a manifest dict; the client validates it into V1Lease
                                                                     _request_timeout=timeout)
            else:
                body["metadata"]["resourceVersion"] = self._version
                written = self._coordination.replace_namespaced_lease(self.name, self.namespace, body,  # type: ignore[arg-type]  # a manifest dict; the client validates it into V1Lease
                                                                      _request_timeout=timeout)
        except ApiException as exc:
            if conflict(exc):
                raise LeaseConflict(f"leader Lease {self.namespace}/{self.name} changed") from exc
            raise
        self._version = written.metadata.resource_version if written.metadata else None
