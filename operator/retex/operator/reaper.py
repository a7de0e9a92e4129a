"""The lease reaper: finds attempts that are gone and has the ledger start the next one.

An attempt (epoch E of a Running task) is gone when
  - its worker released the lease (graceful stop: eviction, drain) — acted on at once;
  - the operator has observed no renewal for the lease duration (crash, node loss, pause);
  - it never took the lease and its Job failed or vanished (a pod that died before starting).
Each is a disruption, not a failure: it does not consume the retry budget. The old Job is deleted
with background propagation; a pod stuck Terminating on a lost node is not waited for.
"""

from __future__ import annotations

import logging
import time

from retex.kube.calls import KubeCalls
from retex.kube.leasewatch import LeaseObserver
from retex.kube.objects import job_name
from retex.ledger import Ledger, TaskRecord
from retex.logs import event
from retex.operator.loop import Loop

log = logging.getLogger(__name__)

# A Job that has not taken its lease is asked about at most this often.
JOB_CHECK_SECONDS = 3.0


def _job_failed(job: dict | None) -> bool:
    if job is None:
        return True
    status = job.get("status") or {}
    failed = any(c.get("type") == "Failed" and c.get("status") == "True" for c in status.get("conditions") or [])
    return failed or bool(status.get("failed"))


class Reaper(Loop):
    name = "reaper"

    def __init__(self, ledger: Ledger, kube: KubeCalls, leases: LeaseObserver, *, interval: float,
                 on_replaced=lambda: None):
        super().__init__()
        self._ledger, self._kube, self._leases = ledger, kube, leases
        self._interval, self._on_replaced = interval, on_replaced
        self._job_checked: dict[tuple[str, int], float] = {}

    def round(self) -> float:
        if not self._leases.synced.is_set():
            return self._interval  # blind while the watch is down: judging now would condemn live workers
        running = self._ledger.running()
        current = {(task.uid, task.epoch) for task in running}
        self._job_checked = {k: v for k, v in self._job_checked.items() if k in current}
        for task in running:
            cause = self.lost_cause(task, time.monotonic())
            if cause:
                self._replace(task, cause)
        return self._interval

    def lost_cause(self, task: TaskRecord, now: float) -> str | None:
        """Why attempt `task.epoch` is gone ('lease-expired', 'disruption'), or None if it is not."""
        seen = self._leases.get(task.uid)
        if seen is not None and seen.holder_epoch == task.epoch:
            return "lease-expired" if seen.expired(now) else None
        if seen is not None and seen.released_by(task.epoch):
            return "disruption"
        # The attempt has not taken the lease yet: its pod may still be starting. Ask its Job.
        key = (task.uid, task.epoch)
        if now - self._job_checked.get(key, 0.0) < JOB_CHECK_SECONDS:
            return None
        self._job_checked[key] = now
        attempt = self._ledger.attempts(task.uid)[-1]
        if attempt.job_name is None:
            return None  # not relayed yet
        if _job_failed(self._kube.get_job(task.namespace, attempt.job_name)):
            return "disruption"
        return None

    def _replace(self, task: TaskRecord, cause: str) -> None:
        event(log, logging.INFO, "attempt gone: starting the next", uid=task.uid, namespace=task.namespace,
              name=task.name, epoch=task.epoch, cause=cause)
        self._ledger.replace_attempt(task.uid, task.epoch, cause=cause)
        self._kube.delete_job(task.namespace, job_name(task.name, task.uid, task.epoch))
        self._on_replaced()
