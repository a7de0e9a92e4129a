"""The lease reaper: watches every attempt that may still be alive and settles what is gone.

An attempt (epoch E) is *known dead* when its worker released the lease, when the operator has
observed no renewal for the lease duration, or when it never held the lease (it can then never run
a step: its first ledger write is fenced). Until then it holds its run slot and concurrency key.

For the current attempt of a Running task:
  - lease released by E — a disruption (eviction, drain): the next attempt at once;
  - lease held by E, no renewal seen for the duration — a disruption ('lease-expired');
  - lease held by E, and the kubelet reported the holder pod's containers terminated (a killed
    or crashed worker) — a disruption, without waiting for the expiry: as soon as the pod watch
    saw it (retex.kube.podwatch, which wakes a round), else once a renewal is late and a look at
    the Job's pods shows it;
  - E never took the lease and its Job failed or vanished — a disruption;
  - E never took the lease within the start deadline and its pod is stuck (missing Secret, image
    pull, no node matches, a quota below the pod) — a failed attempt, with the pod's reason as
    lastError; a pod that is only slow (capacity, a throttling quota, a long pull) keeps waiting;
  - cancel or delete requested and E holds no lease — Cancelled now (no worker will reach a
    step boundary).
For an attempt the operator already ended (task timeout, deletion): settled once known dead, which
frees its slot and key, and its Job deleted if it has not finished. With no Lease left (deleted
with its Task or namespace), its workers can renew nothing: known dead once its pods' ends are
reported, or a lease duration after the Lease was found gone (`_dead_without_lease`).

Every verdict is confirmed with a GET of the Lease first, so a stalled watch or a paused operator
cannot condemn live workers. The old Job is deleted with background propagation; a pod stuck
Terminating on a lost node is not waited for.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from retex.kube.errors import forbidden, transient
from retex.kube.leasewatch import LeaseObservation, LeaseObserver
from retex.kube.objects import job_name, lease_name
from retex.kube.operator_calls import KubeCalls
from retex.kube.podwatch import PodEndings, containers_terminated
from retex.ledger import Ledger, LedgerError, WatchedAttempt
from retex.logs import log_line
from retex.machine import TaskPhase
from retex.operator.loop import STOPPED_LEADING, Loop
from retex.operator.metrics import count_failure
from retex.operator.starting import start_verdict

log = logging.getLogger(__name__)

# A Job that has not taken its lease, or whose holder's renewals are late, is asked about at most
# this often.
JOB_CHECK_SECONDS = 3.0
# A worker renews every fifth of its renew deadline or sooner: a lease unrenewed for a quarter of
# its duration has missed a renewal, and its holder's pod is worth a look.
LATE_RENEWAL_FRACTION = 0.25
# In its first JOB_CHECK_SECONDS of lateness a holder's pod is looked at again after this long (a
# round): a kubelet reports a killed container a second or two after the kill, so a first look can
# come too early, and each second waited then is a second more before the next attempt. Later
# (a frozen worker, an API brownout), every JOB_CHECK_SECONDS.
LATE_HOLDER_LOOK_SECONDS = 1.0
# Pod LISTs for late holders in one round, at most: in an API brownout every renewal is late, and a
# LIST per running attempt would stretch the round past the liveness probe's wedge floor. The
# attempts looked at least recently go first, so all of them take turns.
POD_LOOKS_PER_ROUND = 10


class Hold(enum.Enum):
    HELD = "held"  # the attempt holds the lease and was seen renewing within the duration
    EXPIRED = "expired"  # it holds the lease but no renewal was seen for the duration
    RELEASED = "released"  # it held the lease and let it go
    NEVER = "never"  # it does not hold it (never took it, or another epoch does, or no lease)


def hold_of(seen: LeaseObservation | None, epoch: int, now: float) -> Hold:
    if seen is not None and seen.holder_epoch == epoch:
        return Hold.EXPIRED if seen.expired(now) else Hold.HELD
    if seen is not None and seen.released_by(epoch):
        return Hold.RELEASED
    return Hold.NEVER


# FailureTarget and SuccessCriteriaMet (Kubernetes 1.31+) come first, when the Job's outcome is
# decided; Failed and Complete only once its pods are gone. Either way the Job is ending by itself.
_JOB_ENDING = ("Complete", "Failed", "FailureTarget", "SuccessCriteriaMet")


def _job_finished(job: dict[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in _JOB_ENDING and c.get("status") == "True" for c in conditions)


def _job_failed(job: dict[str, Any] | None) -> bool:
    if job is None:
        return True
    status = job.get("status") or {}
    failed = any(c.get("type") == "Failed" and c.get("status") == "True" for c in status.get("conditions") or [])
    return failed or bool(status.get("failed"))


class Reaper(Loop):
    name = "reaper"

    def __init__(self, ledger: Ledger, kube: KubeCalls, leases: LeaseObserver, pods: PodEndings, *, interval: float,
                 start_deadline_seconds: float, on_replaced: Callable[[], None] = lambda: None):
        super().__init__()
        self._ledger, self._kube, self._leases, self._pods = ledger, kube, leases, pods
        pods.on_ended = self.wake.set  # a death the watch saw is judged now, not at the next round
        self._interval, self._on_replaced = interval, on_replaced
        self.period = interval
        self._start_deadline = start_deadline_seconds
        self._job_checked: dict[tuple[str, int], float] = {}
        self._lease_gone_since: dict[tuple[str, int], float] = {}  # an ended attempt's Lease first found gone
        self._slow: set[tuple[str, int]] = set()  # past the start deadline, only slow: logged once
        self._pod_looks_left = POD_LOOKS_PER_ROUND
        self._nodes_forbidden_said = False

    def round(self) -> float:
        if not self._leases.synced.is_set():
            return self._interval  # blind while the watch is down: judging now would condemn live workers
        watched = self._ledger.watched()
        self._pod_looks_left = POD_LOOKS_PER_ROUND
        keys = {(a.uid, a.epoch) for a in watched}
        self._job_checked = {k: v for k, v in self._job_checked.items() if k in keys}
        self._lease_gone_since = {k: v for k, v in self._lease_gone_since.items() if k in keys}
        self._slow &= keys
        for attempt in sorted(watched, key=lambda a: self._job_checked.get((a.uid, a.epoch), 0.0)):
            try:
                if attempt.current:
                    self._judge_current(attempt)
                else:
                    self._judge_ended(attempt)
            except (LedgerError, *STOPPED_LEADING):
                raise  # Postgres is down for everyone, or this replica no longer leads: the loop decides
            except Exception as exc:  # an API call refused or failed: this attempt waits for the next round
                count_failure(self.name, exc)
                log_line(log, logging.WARNING, "reaper: judging an attempt failed; judged again next round",
                         uid=attempt.uid, namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch,
                         error=f"{type(exc).__name__}: {exc}")
        return self._interval

    # -- verdicts --------------------------------------------------------------------------

    def _judge_current(self, attempt: WatchedAttempt) -> None:
        hold = self._observed(attempt)
        if hold is Hold.HELD:
            dead = self._dead_holder(attempt)
            if dead is not None and self._confirmed(attempt, hold) and self._seen(attempt) == dead:
                log_line(log, logging.INFO, "lease holder's pod terminated: not waiting for the lease to expire",
                         uid=attempt.uid, namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch)
                self._replace(attempt, "disruption")
            return
        if hold is not Hold.NEVER:
            if self._confirmed(attempt, hold):
                self._replace(attempt, "lease-expired" if hold is Hold.EXPIRED else "disruption")
            return
        # The attempt does not hold the lease: its pod may still be starting.
        if attempt.cancel_requested:
            if self._confirmed(attempt, hold):
                self._cancel(attempt)
            return
        if attempt.job_name is None:
            return  # not relayed yet
        if not self._due_for_a_look(attempt):
            return
        if _job_failed(self._kube.get_job(attempt.namespace, attempt.job_name)):
            if self._confirmed(attempt, hold):
                self._replace(attempt, "disruption")
        elif attempt.dispatched_seconds_ago is not None and attempt.dispatched_seconds_ago > self._start_deadline:
            if self._confirmed(attempt, hold):
                self._not_started(attempt)

    def _judge_ended(self, attempt: WatchedAttempt) -> None:
        """An attempt the operator ended while its worker may still be inside a step."""
        hold = self._observed(attempt)
        confirmed = hold is not Hold.HELD and self._confirmed(attempt, hold)
        if self._seen(attempt) is not None:  # a Lease is there: a wait without one starts afresh
            self._lease_gone_since.pop((attempt.uid, attempt.epoch), None)
        if not confirmed:
            return
        if self._seen(attempt) is None and not self._dead_without_lease(attempt):
            return
        self._delete_unfinished_job(attempt)
        log_line(log, logging.INFO, "ended attempt is known dead: its slot and key are free", uid=attempt.uid,
                 namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch, hold=hold.value)
        self._ledger.settle_attempt(attempt.uid, attempt.epoch)
        self._on_replaced()

    def _dead_without_lease(self, attempt: WatchedAttempt) -> bool:
        """No Lease at all (deleted with its Task or namespace): no worker of the attempt can show a
        lease held since it went (a renewal finds none, LeaseNotFound), so each gave its step up by
        its renew deadline R and killed it within K, R + K < D, as when a lease expires. Dead once
        each pod of its Job ended as the kubelet reported, or once the reaper has seen no Lease for
        the lease duration D that pod's worker runs with (RETEX_LEASE_DURATION_SECONDS, from its
        Job): a pod stuck Terminating on a lost node, whose end no kubelet reports, holds the slot
        and key for D, not for as long as the node is away. Neither the node nor the pod's phase
        tells more: a node NotReady or gone may still run its containers (a kubelet that died or is
        cut off), and the control plane marks a deleted Node's pods Failed while their processes
        may still run. A pod that names no lease duration (not made by a worker's Job) is waited
        for until its end is reported."""
        now = time.monotonic()
        gone_for = now - self._lease_gone_since.setdefault((attempt.uid, attempt.epoch), now)
        pods = self._kube.job_pods(attempt.namespace, self._job(attempt))
        return all(containers_terminated(pod) or gone_for >= (_lease_duration(pod) or math.inf) for pod in pods)

    def _delete_unfinished_job(self, attempt: WatchedAttempt) -> None:
        """A dead attempt's Job that has not finished (a pod Pending for good; a Job the relay was
        told may be left) would hold its pod of the quota until its activeDeadlineSeconds, or for
        ever; a finished one, or one whose pods have ended, goes by its TTL, its pod keeping the
        worker's log until then. A failure that may clear waits for the next round; a refusal for
        good (403) is logged and the attempt settled all the same, or it would hold its slot for
        ever."""
        job = self._job(attempt)
        try:
            found = self._kube.get_job(attempt.namespace, job)
            if found is not None and not _job_finished(found) and not self._pods_ended(attempt.namespace, job):
                self._kube.delete_job(attempt.namespace, job)
        except Exception as exc:
            if transient(exc):
                raise
            count_failure(self.name, exc)
            log_line(log, logging.WARNING, "the dead attempt's unfinished Job could not be deleted; settled all the same",
                     uid=attempt.uid, namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch, job=job,
                     error=f"{type(exc).__name__}: {exc}")

    def _pods_ended(self, namespace: str, job: str) -> bool:
        """Its pods ended, as the kubelet reported: the Job controller's condition follows."""
        pods = self._kube.job_pods(namespace, job)
        return bool(pods) and all(containers_terminated(p) for p in pods)

    def _observed(self, attempt: WatchedAttempt) -> Hold:
        return hold_of(self._seen(attempt), attempt.epoch, time.monotonic())

    def _dead_holder(self, attempt: WatchedAttempt) -> LeaseObservation | None:
        """The observation of a holder whose pod's containers have terminated, as the pod watch
        saw, or as a look at the Job's pods shows once its renewals are late: no process of it is
        left to run a step, so the next attempt need not wait for the lease to expire. The caller's
        GET must then show that same observation: a renewal the watch missed, or the attempt's
        other pod holding the lease now (R10), is a live holder."""
        seen = self._seen(attempt)
        if seen is None or seen.holder_pod is None:
            return None
        if self._pods.ended(attempt.namespace, self._job(attempt), seen.holder_pod):
            return seen  # the watch saw it end: no renewal need be late, no pod LIST
        late_for = time.monotonic() - seen.changed_at - seen.duration_seconds * LATE_RENEWAL_FRACTION
        if late_for < 0:
            return None
        every = LATE_HOLDER_LOOK_SECONDS if late_for < JOB_CHECK_SECONDS else JOB_CHECK_SECONDS
        if self._pod_looks_left <= 0 or not self._due_for_a_look(attempt, every):
            return None
        self._pod_looks_left -= 1
        pods = self._kube.job_pods(attempt.namespace, self._job(attempt))
        died = any(p["metadata"]["name"] == seen.holder_pod and containers_terminated(p) for p in pods)
        return seen if died else None

    def _due_for_a_look(self, attempt: WatchedAttempt, every: float = JOB_CHECK_SECONDS) -> bool:
        """Whether the attempt's Job or pods may be asked about now (at most `every` seconds
        apart); if so, the look is counted from now."""
        now, key = time.monotonic(), (attempt.uid, attempt.epoch)
        if now - self._job_checked.get(key, 0.0) < every:
            return False
        self._job_checked[key] = now
        return True

    def _seen(self, attempt: WatchedAttempt) -> LeaseObservation | None:
        return self._leases.get(attempt.namespace, _lease(attempt), attempt.uid)

    def _confirmed(self, attempt: WatchedAttempt, hold: Hold) -> bool:
        """Before acting on what the watch showed, read the Lease itself: True if it still says
        `hold`. A renewal the watch missed (a stalled stream, a paused operator) is recorded and
        the attempt is judged again next round, so no live worker is condemned on stale news."""
        lease = self._kube.get_lease(attempt.namespace, _lease(attempt))
        seen = self._leases.confirm(attempt.namespace, _lease(attempt), attempt.uid, lease)
        return hold_of(seen, attempt.epoch, time.monotonic()) is hold

    # -- actions ---------------------------------------------------------------------------

    def _replace(self, attempt: WatchedAttempt, cause: str) -> None:
        self._ledger.replace_attempt(attempt.uid, attempt.epoch, cause=cause)
        # The ledger refuses a replacement of an attempt that ended meanwhile (its worker completed
        # the task and exited, and the reaper saw the pod terminated): only `replace_attempt`
        # ends an attempt as lost. Such a Job finished: its pod keeps the worker's log.
        ended = next((a.outcome for a in self._ledger.attempts(attempt.uid) if a.epoch == attempt.epoch), None)
        if ended != "lost":
            log_line(log, logging.INFO, "attempt ended before it was found gone: nothing to replace", uid=attempt.uid,
                     namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch, outcome=ended)
            return
        log_line(log, logging.INFO, "attempt lost: replaced (or ended by its cancel or disruption budget)",
                 uid=attempt.uid, namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch, cause=cause)
        self._kube.delete_job(attempt.namespace, self._job(attempt))
        self._on_replaced()

    def _not_started(self, attempt: WatchedAttempt) -> None:
        job = self._job(attempt)
        verdict = start_verdict(self._kube.job_pods(attempt.namespace, job),
                                self._kube.job_events(attempt.namespace, job), node_labelled=self._node_labelled)
        why = verdict.why
        if not verdict.stuck:
            if (attempt.uid, attempt.epoch) not in self._slow:
                self._slow.add((attempt.uid, attempt.epoch))
                log_line(log, logging.INFO, "worker not started by the deadline, but only slow: waiting",
                         uid=attempt.uid, namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch, why=why)
            return
        message = f"worker of attempt {attempt.epoch} did not start within {self._start_deadline:.0f}s: {why}"
        record = self._ledger.fail_unstarted(attempt.uid, attempt.epoch, message)
        if record.epoch == attempt.epoch and record.phase == TaskPhase.RUNNING:
            return  # its worker claimed the attempt after the Lease was read: it runs, keep its Job
        log_line(log, logging.WARNING, "worker never started: a failed attempt", uid=attempt.uid,
                 namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch, why=why)
        self._kube.delete_job(attempt.namespace, job)
        self._on_replaced()

    def _node_labelled(self, selector: dict[str, str]) -> bool:
        """Whether any node carries these labels; True (not known otherwise) where the operator may
        not list nodes (a ClusterRole kept from before that rule), so the scheduler's message
        decides as it did then, rather than no verdict at all every round."""
        try:
            return self._kube.node_labelled(selector)
        except Exception as exc:
            if not forbidden(exc):
                raise
            if not self._nodes_forbidden_said:
                self._nodes_forbidden_said = True
                log_line(log, logging.WARNING, "may not list nodes: an unschedulable worker's nodeSelector is judged "
                         "by the scheduler's message alone (apply the ClusterRole of this release)", error=str(exc))
            return True

    def _cancel(self, attempt: WatchedAttempt) -> None:
        log_line(log, logging.INFO, "cancel requested and no worker holds the lease: cancelled now", uid=attempt.uid,
                 namespace=attempt.namespace, name=attempt.name, epoch=attempt.epoch)
        self._ledger.cancel_unheld(attempt.uid, attempt.epoch)
        self._kube.delete_job(attempt.namespace, self._job(attempt))
        self._on_replaced()

    @staticmethod
    def _job(attempt: WatchedAttempt) -> str:
        return attempt.job_name or job_name(attempt.name, attempt.uid, attempt.epoch)


def _lease_duration(pod: dict[str, Any]) -> float | None:
    """The lease duration the pod's worker runs with, as its Job set it (retex.kube.objects.build_job);
    None when the pod names none."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for var in container.get("env") or []:
            if var.get("name") == "RETEX_LEASE_DURATION_SECONDS":
                try:
                    return float(var["value"])
                except (KeyError, TypeError, ValueError):
                    return None
    return None


def _lease(attempt: WatchedAttempt) -> str:
    """The name of the attempt's Lease: looked up by namespace and name, never by label alone."""
    return lease_name(attempt.name, attempt.uid)
