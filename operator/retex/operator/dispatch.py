"""Turning ledger decisions into Kubernetes objects: the outbox relay and the due-task promoter."""

from __future__ import annotations

import logging
import math
import time
from datetime import UTC, datetime

from retex.api import TaskSpec
from retex.failpoints import failpoint
from retex.kube.calls import KubeCalls
from retex.kube.objects import FAILPOINT_ANNOTATION, WorkerDefaults, build_job, build_lease
from retex.ledger import Dispatch, Ledger
from retex.logs import event
from retex.operator.loop import Loop

log = logging.getLogger(__name__)


class Relay(Loop):
    """Outbox → Lease + Job. Wakes when poked, and every `interval` seconds regardless.

    A round that fails (API server down or refusing) rolls its claims back: the records wait for
    the next round; nothing is lost and nothing is sent twice (AlreadyExists is success)."""

    name = "relay"

    def __init__(self, ledger: Ledger, kube: KubeCalls, defaults: WorkerDefaults, *, interval: float,
                 failpoints_from_annotations: bool = False):
        super().__init__()
        self._ledger, self._kube, self._defaults, self._interval = ledger, kube, defaults, interval
        self._failpoints = failpoints_from_annotations

    def round(self) -> float:
        while self.relay_once():
            pass
        return self._interval

    def relay_once(self) -> int:
        """Relay one batch; return how many records it sent."""
        with self._ledger.dispatch_batch(limit=20) as (batch, mark_sent):
            for dispatch in batch:
                mark_sent(dispatch, self._send(dispatch))
            return len(batch)

    def _send(self, dispatch: Dispatch) -> str | None:
        task = self._kube.get_task(dispatch.namespace, dispatch.name)
        if task is None or task["metadata"]["uid"] != dispatch.task_uid:
            # Deleted while nobody watched (the operator was down): stop it, keep its history.
            self._ledger.abandon(dispatch.task_uid, reason="TaskDeleted")
            return None
        failpoint_armed = None
        if self._failpoints and dispatch.epoch == 1:
            failpoint_armed = (task["metadata"].get("annotations") or {}).get(FAILPOINT_ANNOTATION)
        spec = TaskSpec.model_validate(dispatch.spec)
        common = {"task_name": dispatch.name, "task_uid": dispatch.task_uid, "namespace": dispatch.namespace}
        self._kube.create_lease(build_lease(**common, duration_seconds=spec.lease.duration_seconds))
        previous_node = None
        if dispatch.epoch > 1:
            previous_node = next((a.node for a in self._ledger.attempts(dispatch.task_uid)
                                  if a.epoch == dispatch.epoch - 1), None)
        job = build_job(**common, epoch=dispatch.epoch, spec=spec, defaults=self._defaults,
                        active_deadline_seconds=_time_left(dispatch), avoid_node=previous_node,
                        failpoint=failpoint_armed)
        self._kube.create_job(job)
        failpoint("after-job-create", task=dispatch.name, uid=dispatch.task_uid)  # crash-matrix R3: Job exists, outbox not yet marked sent
        event(log, logging.INFO, "attempt dispatched", uid=dispatch.task_uid, namespace=dispatch.namespace,
              name=dispatch.name, epoch=dispatch.epoch, job=job["metadata"]["name"])
        return job["metadata"]["name"]


class Promoter(Loop):
    """Starts Scheduled and Retrying tasks when due, sleeping until the earliest one (no per-task
    timers; a far-future task costs nothing until its time)."""

    name = "promoter"

    def __init__(self, ledger: Ledger, relay: Relay, *, max_sleep: float = 5.0,
                 retention_seconds: float | None = None):
        super().__init__()
        self._ledger, self._relay, self._max_sleep = ledger, relay, max_sleep
        self._retention_seconds = retention_seconds
        self._next_purge = 0.0

    def round(self) -> float:
        if self._ledger.promote_due():
            self._relay.wake.set()
        if self._retention_seconds and time.monotonic() >= self._next_purge:
            purged = self._ledger.purge_finished(older_than_seconds=self._retention_seconds)
            if purged:
                log.info("purged %d finished tasks past the history retention", purged)
            self._next_purge = time.monotonic() + 3600
        due = self._ledger.next_due_at()
        if due is None:
            return self._max_sleep
        return min(self._max_sleep, max(0.0, (due - datetime.now(UTC)).total_seconds()))



def _time_left(dispatch: Dispatch) -> int | None:
    """The Job's activeDeadlineSeconds: what is left of the task's timeout, plus a margin so the
    ledger's Timeout (which fences the worker) lands first and Kubernetes only stops stragglers."""
    if dispatch.deadline_at is None:
        return None
    return max(1, math.ceil((dispatch.deadline_at - datetime.now(UTC)).total_seconds())) + 10
