"""One watcher over every retex worker Lease, recording what the operator has *observed*.

Liveness is judged as client-go's leader election does: an attempt is lost when the operator has
seen no change of the lease's holder or renewTime for the lease duration, measured on the
operator's own monotonic clock. The worker's renewTime is never compared with our clock. The watch
only updates a table; a reaper reads it, so lease renewals cause no handler storms.

Observations are keyed by the Lease's namespace and name, and read back only for the task uid
its label names: a Lease anyone else creates (in another namespace, with a victim's label) is
another key, so it can neither keep a dead worker looking alive nor make a live one look gone.

Blind spots: while the watch is down nothing is seen, so the time it was down is not counted
against a lease (a relist moves an unchanged lease's timer forward by the blind time only, never
resets it: a watch that fails often still expires a dead worker after its duration plus the time
it was blind). A watch that stalls without an error, or an operator that was paused, shows stale
observations; the reaper therefore confirms a lease with a GET (`confirm`) before acting on one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from kubernetes import client

from retex.failpoints import failpoint
from retex.kube.leases import parse_holder
from retex.kube.objects import LABEL_TASK_UID
from retex.kube.watching import ObjectKey, list_then_watch, object_key


@dataclass(frozen=True)
class LeaseObservation:
    task_uid: str  # the Lease's retex.dev/task-uid label
    holder_pod: str | None  # None: free or released
    holder_epoch: int | None
    last_epoch: int | None  # the epoch of the latest holder ever seen (survives a release)
    duration_seconds: int
    changed_at: float  # time.monotonic() when holder or renewTime last changed, as we saw it
    changed_wall: float  # time.time() of the same moment, for status display only

    def expired(self, now: float) -> bool:
        return self.holder_epoch is not None and now - self.changed_at > self.duration_seconds

    def released_by(self, epoch: int) -> bool:
        return self.holder_epoch is None and self.last_epoch == epoch


def _instant(renew_time: str | None) -> datetime | None:
    """renewTime as an instant: a watch event spells it `...Z`, a GET or LIST through the client's
    serializer `...+00:00`; the same renewal must compare equal (else a GET looks like one)."""
    return datetime.fromisoformat(renew_time.replace("Z", "+00:00")) if renew_time else None


class LeaseObserver:
    def __init__(self, api: client.ApiClient, *, clock: Callable[[], float] = time.monotonic):
        self._coordination = client.CoordinationV1Api(api)
        self._clock = clock
        self._by_key: dict[ObjectKey, LeaseObservation] = {}
        self._renewals: dict[ObjectKey, tuple[str | None, datetime | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._blind_since: float | None = None  # when the watch last went down
        self.synced = threading.Event()

    def confirm(self, namespace: str, name: str, task_uid: str, lease: dict[str, Any] | None) -> LeaseObservation | None:
        """Record the Lease `namespace/name` just read with a GET (None: it is gone) and return the
        observation: a renewal the watch has not delivered (stalled stream, paused operator)
        counts as one."""
        if lease is None:
            with self._lock:
                self._by_key.pop((namespace, name), None)
                self._renewals.pop((namespace, name), None)
        else:
            self._observe(lease)
        return self.get(namespace, name, task_uid)

    def relisted(self, leases: list[dict[str, Any]]) -> None:
        """A fresh LIST after a blind spot. While we could not watch we could not see renewals
        either: the blind time is not counted against a lease (an API server restart condemns no
        one), but the time we could see is (a watch that keeps failing still expires the dead)."""
        blind = self._clock() - self._blind_since if self._blind_since is not None else 0.0
        self._blind_since = None
        listed = {object_key(lease) for lease in leases}
        with self._lock:  # deleted while we were blind
            for key in set(self._by_key) - listed:
                self._by_key.pop(key, None)
                self._renewals.pop(key, None)
        for lease in leases:
            self._observe(lease, relisted=True, blind=blind)

    def grant_grace(self) -> None:
        """Count every lease as renewed now: a replica that just became leader judges no worker
        by what it saw (or missed) as a standby, so a failover never condemns a live worker; a
        dead one is replaced one lease duration later."""
        now = self._clock()
        with self._lock:
            for key, seen in self._by_key.items():
                self._by_key[key] = replace(seen, changed_at=max(seen.changed_at, now))

    def went_blind(self) -> None:
        """The watch is down: nothing is seen from now until the next relist."""
        self.synced.clear()
        if self._blind_since is None:
            self._blind_since = self._clock()

    def get(self, namespace: str, name: str, task_uid: str) -> LeaseObservation | None:
        """What was seen of the Lease `namespace/name`, if it is labelled for `task_uid`."""
        with self._lock:
            seen = self._by_key.get((namespace, name))
        return seen if seen is not None and seen.task_uid == task_uid else None

    def stop(self) -> None:
        self._stop.set()

    def _observe(self, lease: dict[str, Any], deleted: bool = False, relisted: bool = False, blind: float = 0.0) -> None:
        meta, spec = lease["metadata"], lease.get("spec") or {}
        uid = (meta.get("labels") or {}).get(LABEL_TASK_UID)
        if not uid:
            return
        key = object_key(lease)
        with self._lock:
            if deleted:
                self._by_key.pop(key, None)
                self._renewals.pop(key, None)
                return
            holder = spec.get("holderIdentity") or None
            seen = (holder, _instant(spec.get("renewTime")))
            previous = self._by_key.get(key)
            if previous and previous.task_uid != uid:
                previous = None  # relabelled: what was seen belonged to another task
            if previous and self._renewals.get(key) == seen:
                if relisted and blind:  # unchanged across a blind spot: forgive the blind time only
                    self._by_key[key] = replace(previous, changed_at=min(self._clock(), previous.changed_at + blind))
                return  # an update that is not a renewal (labels, owner refs): not a sign of life
            try:
                parsed = parse_holder(holder)
            except ValueError:  # not written by a retex worker: nobody we know holds it
                parsed = None
            pod, epoch = (parsed.pod, parsed.epoch) if parsed else (None, None)
            self._renewals[key] = seen
            self._by_key[key] = LeaseObservation(
                task_uid=uid, holder_pod=pod, holder_epoch=epoch,
                last_epoch=epoch if epoch is not None else (previous.last_epoch if previous else None),
                duration_seconds=int(spec.get("leaseDurationSeconds") or 15),
                changed_at=self._clock(), changed_wall=time.time(),
            )

    def run(self) -> None:
        list_then_watch(self._coordination.list_lease_for_all_namespaces, label_selector=LABEL_TASK_UID,
                        stopped=self._stop, listed=self._listed, changed=self._changed, went_blind=self.went_blind,
                        what="lease",
                        # =raise: outside the loop's handling, so the thread dies (the probes' test)
                        before_each_round=lambda: failpoint("in-lease-watch"))

    def _listed(self, leases: list[dict[str, Any]]) -> None:
        self.relisted(leases)
        self.synced.set()

    def _changed(self, kind: str, lease: dict[str, Any]) -> None:
        self._observe(lease, deleted=kind == "DELETED")
