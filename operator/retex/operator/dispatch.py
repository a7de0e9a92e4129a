"""Turning ledger decisions into Kubernetes objects: the outbox relay and the due-task promoter."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from retex.api import TaskSpec
from retex.failpoints import failpoint
from retex.kube.errors import NamespaceTerminating, NotPermitted, Refused, transient
from retex.kube.objects import FAILPOINT_ANNOTATION, WorkerDefaults, build_job, build_lease, job_name
from retex.kube.operator_calls import KubeCalls
from retex.ledger import Dispatch, DispatchOutcomes, Ledger, LedgerError, spec_hash
from retex.logs import log_line
from retex.operator.admission import NAMESPACE_NOT_ONBOARDED, not_onboarded_message
from retex.operator.loop import STOPPED_LEADING, Loop
from retex.operator.metrics import count_failure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Unsent:
    """Why a record ends without a Job: dropped (its task ends Cancelled with `reason`) when
    `error` is None, else rejected (its task fails with `reason`, `error` as lastError)."""

    reason: str
    why: str  # the log line
    error: str | None = None


class Relay(Loop):
    """Outbox → Lease + Job. Wakes when poked, and every `interval` seconds regardless.

    A round claims one batch of due records in a short ledger transaction, then makes each
    record's API calls outside any transaction, and settles the record in a short transaction of
    its own, fenced by the leadership term and only while the record is still its claim: a slow
    API server holds no ledger transaction open (whose idle limit would end it) and no lock
    (placement's among them) while it answers.

    Each record is settled on its own, so no record can hold up the ones behind it: sent; rejected
    when the API server refuses its Lease or Job for good (the task fails with reason JobRejected
    and the server's message); dropped when its task was cancelled or deleted, or its Task object
    is gone or terminating, or its namespace is (the task ends Cancelled with the cancel's reason);
    deferred, with a backoff of its own, on a transient error or an API error answering a read
    (the Task's GET), for at most `defer_limit_seconds`
    since the first deferral; past that, or on an error repeating cannot cure, the task fails with
    reason DispatchFailed. A relay that dies mid-batch loses nothing: its claims lapse after
    `claim_seconds` and the next relay claims the records again, meets their Jobs as AlreadyExists
    (ours, so success) — or, if it ends a record unsent, deletes such a Job and leaves the attempt
    to the reaper until its worker is dead. The operator's `claim_seconds` is the election's
    D − R: a claim taken while leading has lapsed by the time a successor may lead."""

    name = "relay"
    batch_size = 10  # a round's length is bounded by one batch's API calls (the probes judge it)

    def __init__(self, ledger: Ledger, kube: KubeCalls, defaults: Callable[[], WorkerDefaults], *, interval: float,
                 claim_seconds: float, defer_limit_seconds: float, failpoints_from_annotations: bool = False):
        super().__init__()
        self._ledger, self._kube, self._defaults, self._interval = ledger, kube, defaults, interval
        self.period = interval
        self._claim_seconds = claim_seconds
        self._defer_limit = defer_limit_seconds
        self._failpoints = failpoints_from_annotations

    def round(self) -> float:
        # One batch a round, the next at once while records are due: between batches the loop
        # asks again whether this replica may write.
        return 0.0 if self.relay_once() else self._interval

    def relay_once(self) -> int:
        """Claim and relay one batch; return how many records it claimed (0: nothing is due)."""
        batch, outcomes = self._ledger.dispatch_batch(limit=self.batch_size, claim_seconds=self._claim_seconds)
        for dispatch in batch:
            self._settle(dispatch, outcomes)
        return outcomes.claimed

    def _settle(self, dispatch: Dispatch, outcomes: DispatchOutcomes) -> None:
        who: dict[str, Any] = {"uid": dispatch.task_uid, "namespace": dispatch.namespace, "name": dispatch.name,
               "epoch": dispatch.epoch}
        try:
            result = self._send_unless_ended(dispatch)
        except (LedgerError, *STOPPED_LEADING):
            raise  # the ledger is away, or this replica no longer leads: the batch ends (its claims lapse)
        except Exception as exc:
            count_failure(self.name, exc)
            # A create's refusal for good arrives as `Refused`; any API answer left came from a
            # read (the Task's GET, perhaps during an RBAC warm-up) and may clear: waited out.
            may_clear = isinstance(exc, ApiException | NotPermitted) or transient(exc)
            given_up = self._given_up(dispatch, f"{type(exc).__name__}: {exc}", may_clear)
            if given_up is None:
                self._defer(dispatch, outcomes, exc, who)
                return
            result = given_up
        if isinstance(result, str):
            if not outcomes.sent(dispatch, result):
                self._not_ours(who)
            return
        # Ending without a Job, so make sure there is none: a relay that died between creating it
        # and settling the record (crash-matrix R3) left one, and its worker may be inside a step.
        name = job_name(dispatch.name, dispatch.task_uid, dispatch.epoch)
        try:
            found = self._kube.delete_job_of(dispatch.namespace, name, dispatch.task_uid)
        except STOPPED_LEADING:
            raise
        except Exception as exc:
            # Not knowing whether a Job exists, end nothing yet: the error may clear. One that
            # lasts (a 403 once the namespace's RoleBinding is gone) must not keep the record for
            # ever: past the defer limit it ends as if a Job were left, so the attempt keeps its
            # slot and key until the reaper finds its worker gone; safe whether or not one exists.
            # A transient error waits on even then: a record deferred for another reason reaches
            # this call already past the limit, and one 503 must not decide it.
            if (dispatch.deferred_seconds or 0.0) < self._defer_limit or transient(exc):
                self._defer(dispatch, outcomes, exc, who)
                return
            count_failure(self.name, exc)
            found = True
            log_line(log, logging.WARNING, "whether a Job was left is unknown past the defer limit: ending as if one was",
                     **who, outcome="dropped" if result.error is None else "rejected", why=f"{type(exc).__name__}: {exc}"[:300])
        left = name if found else None
        if result.error is None:
            settled = outcomes.dropped(dispatch, reason=result.reason, job_name=left)
        else:
            settled = outcomes.rejected(dispatch, result.error, reason=result.reason, job_name=left)
        if not settled:
            self._not_ours(who)
            return
        fields = {**who, **({"why": result.error[:300]} if result.error else {}),
                  **({"job_deleted": left} if left else {})}
        log_line(log, logging.INFO if result.error is None else logging.WARNING, result.why, **fields)

    def _send_unless_ended(self, dispatch: Dispatch) -> str | _Unsent:
        """Send the record (its Job's name), or say why it ends unsent."""
        if dispatch.cancel_reason:
            return _Unsent(dispatch.cancel_reason, "dispatch dropped: cancel requested")
        try:
            task = self._kube.get_task(dispatch.namespace, dispatch.name)
            meta = task["metadata"] if task else {}
            if task is None or meta.get("uid") != dispatch.task_uid or meta.get("deletionTimestamp"):
                # Deleted (perhaps while nobody watched): stop it, keep its history, send nothing.
                return _Unsent("TaskDeleted", "dispatch dropped: Task deleted")
            if (task.get("spec") or {}).get("cancel"):  # the cancel handler may not have run yet
                return _Unsent("Cancelled", "dispatch dropped: cancel requested")
            # The control plane trusts only the Task: the Job is built from the live object, and a
            # ledger copy that differs (written by anyone but admission) gets no Job at all.
            spec = TaskSpec.model_validate(task["spec"])
            if spec.as_admitted() != dispatch.spec:
                return _Unsent("SpecMismatch", "dispatch refused: the ledger's spec is not the Task's",
                               f"the ledger's copy of the spec differs from the Task's (hash "
                               f"{spec_hash(dispatch.spec)[:12]}, the Task's {spec_hash(spec.as_admitted())[:12]}): "
                               "nothing is dispatched from it")
            return self._send(dispatch, task, spec)
        except NamespaceTerminating:
            # Its namespace is being deleted, the Task with it (perhaps not marked yet).
            return _Unsent("TaskDeleted", "dispatch dropped: namespace terminating")
        except NotPermitted as refused:
            # Its RoleBinding was removed after admission, or is not there yet (an upgrade that
            # applied the new RBAC before onboarding the namespaces with Tasks): waited out like a
            # transient error, and judged only past the limit.
            if (dispatch.deferred_seconds or 0.0) < self._defer_limit:
                raise
            return _Unsent(NAMESPACE_NOT_ONBOARDED, "dispatch refused by RBAC: namespace not onboarded",
                           not_onboarded_message(dispatch.namespace, refused.message))
        except Refused as refused:
            return _Unsent("JobRejected", f"dispatch rejected by the API server ({refused.status}): task failed",
                           refused.message)

    def _given_up(self, dispatch: Dispatch, why: str, may_clear: bool) -> _Unsent | None:
        """After an error: the task fails (DispatchFailed) if repeating cannot help or the record
        has been deferred past the limit; None: defer it."""
        if not may_clear:  # a spec the models refuse, a bug: it fails the same way every time
            return _Unsent("DispatchFailed", "dispatch failed: task failed",
                           f"the attempt could not be dispatched: {why}")
        if (dispatch.deferred_seconds or 0.0) >= self._defer_limit:
            return _Unsent("DispatchFailed", "dispatch deferred past the limit: task failed",
                           f"not dispatched for {dispatch.deferred_seconds:.0f}s; last error: {why}")
        return None

    def _defer(self, dispatch: Dispatch, outcomes: DispatchOutcomes, exc: Exception, who: dict[str, Any]) -> None:
        """429, 5xx, a dropped connection, an API error answering a read: this record alone waits."""
        why = f"{type(exc).__name__}: {exc}"
        delay = outcomes.deferred(dispatch, why)
        if delay is None:
            self._not_ours(who)
            return
        log_line(log, logging.WARNING, "dispatch deferred after an error that may clear", **who, retry_in_seconds=delay,
                 why=why[:300])

    @staticmethod
    def _not_ours(who: dict[str, Any]) -> None:
        """The record was no longer this relay's claim when it came to settle it: settled, claimed
        again after this claim lapsed, or held (its task frozen). It is left to whoever holds it."""
        log_line(log, logging.WARNING, "dispatch record no longer this relay's claim: left as it is", **who)

    def _send(self, dispatch: Dispatch, task: dict[str, Any], spec: TaskSpec) -> str:
        failpoint_armed = None
        if self._failpoints and dispatch.epoch == 1:
            failpoint_armed = (task["metadata"].get("annotations") or {}).get(FAILPOINT_ANNOTATION)
        common = {"task_name": dispatch.name, "task_uid": dispatch.task_uid, "namespace": dispatch.namespace}
        self._kube.create_lease(build_lease(**common, duration_seconds=spec.lease.duration_seconds))
        previous_node = None
        if dispatch.epoch > 1:
            previous_node = next((a.node for a in self._ledger.attempts(dispatch.task_uid)
                                  if a.epoch == dispatch.epoch - 1), None)
        job = build_job(**common, epoch=dispatch.epoch, spec=spec, defaults=self._defaults(),
                        active_deadline_seconds=_time_left(self._ledger, dispatch), avoid_node=previous_node,
                        failpoint=failpoint_armed)
        self._kube.create_job(job)
        # crash-matrix R3: Job exists, outbox not yet marked sent
        failpoint("after-job-create", task=dispatch.name, uid=dispatch.task_uid)
        log_line(log, logging.INFO, "attempt dispatched", uid=dispatch.task_uid, namespace=dispatch.namespace,
                 name=dispatch.name, epoch=dispatch.epoch, job=job["metadata"]["name"])
        name: str = job["metadata"]["name"]
        return name


class Promoter(Loop):
    """Starts Scheduled and Retrying tasks when due, sleeping until the earliest one (no per-task
    timers; a far-future task costs nothing until its time). Every `refill_seconds` it also fills
    free slots: the backstop for a placement that skipped a briefly locked queue head."""

    name = "promoter"

    def __init__(self, ledger: Ledger, relay: Relay, *, max_sleep: float = 5.0, refill_seconds: float = 5.0,
                 retention_seconds: float | None = None):
        super().__init__()
        self._ledger, self._relay, self._max_sleep = ledger, relay, max_sleep
        self.period = max_sleep
        self._refill_seconds, self._next_refill = refill_seconds, 0.0
        self._retention_seconds = retention_seconds
        self._next_purge = 0.0

    def round(self) -> float:
        if self._ledger.promote_due():
            self._relay.wake.set()
        if time.monotonic() >= self._next_refill:
            self._ledger.fill_slots()
            self._relay.wake.set()
            self._next_refill = time.monotonic() + self._refill_seconds
        if self._retention_seconds and time.monotonic() >= self._next_purge:
            purged = self._ledger.purge_finished(older_than_seconds=self._retention_seconds)
            if purged:
                log_line(log, logging.INFO, "finished tasks purged past the history retention", count=purged)
            self._next_purge = time.monotonic() + 3600
        due = self._ledger.next_due_at()
        if due is None:
            return self._max_sleep
        return min(self._max_sleep, max(0.0, self._ledger.seconds_until(due)))


def _time_left(ledger: Ledger, dispatch: Dispatch) -> int | None:
    """The Job's activeDeadlineSeconds: what is left of the task's timeout, plus a margin so the
    ledger's Timeout (which fences the worker) lands first and Kubernetes only stops stragglers.
    Measured on the database clock that set the deadline, never against the operator's."""
    if dispatch.deadline_at is None:
        return None
    return max(1, math.ceil(ledger.seconds_until(dispatch.deadline_at))) + 10
