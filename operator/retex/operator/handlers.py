"""kopf handlers: thin glue. Decisions live in the ledger; API calls in retex.kube.

kopf settings chosen (see docs/operator.md for why): progress in annotations under kopf.retex.dev,
a diff base reduced to what the handlers react to, our own finalizer name, handlers return None
(nothing dumped into status), watch timeouts so a silent stream reconnects, sync handlers (kopf
runs them in its thread pool, so the blocking Kubernetes and Postgres clients never stall its
event loop), log lines not posted as Events.

Only the elected leader runs kopf at all (retex.operator.main): kopf writes on its own, whatever
the handlers do — it adds its finalizer to every Task it sees, takes it off again when no handler
matches (a `when=` filter saying no), stores its diff base and progress annotations (a
kopf.TemporaryError writes them too). A standby running kopf raced the leader's finalizer patch on
the rig, and the leader then never admitted that Task. Every handler is also `leader_only`: between
losing the lease and kopf stopping, a handler waits instead of writing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, cast

import kopf
import pydantic

from retex.api import GROUP, PLURAL, REFUSED, VERSION, ConditionType, TaskSpec, TaskStatus, find_condition
from retex.failpoints import failpoint
from retex.kube.client import api_client
from retex.kube.election import LeaderLease
from retex.kube.errors import NotPermitted, Refused
from retex.kube.humans import (
    RECOVER_ANNOTATION,
    RECOVER_MODES,
    REQUESTED_BY_ANNOTATION,
    REQUEUE_ANNOTATION,
    RESOLVE_ANNOTATION,
)
from retex.kube.identity import WorkerIdentities
from retex.kube.install import install_uid
from retex.kube.leasewatch import LeaseObserver
from retex.kube.objects import build_job, job_name, lease_name
from retex.kube.operator_calls import KubeCalls
from retex.kube.podwatch import PodEndings
from retex.ledger import (
    AdmitResult,
    Ledger,
    LedgerError,
    LedgerUnavailable,
    NamespaceQuota,
    NotFrozen,
    NotLeader,
    Refusal,
    TaskAdmission,
    TaskNotFound,
    TaskRecord,
)
from retex.logs import log_line
from retex.machine import IllegalTransition
from retex.operator import ledger_endpoint
from retex.operator.admission import (
    NAMESPACE_NOT_ONBOARDED,
    QUOTA_EXCEEDED,
    admission_for,
    annotations_refusal,
    invalid_spec_message,
    not_onboarded_message,
    quota_message,
)
from retex.operator.dispatch import Promoter, Relay
from retex.operator.health import LoopState, Verdict, liveness, readiness, term_overdue
from retex.operator.leadership import Leadership
from retex.operator.loop import STOPPED_LEADING, Loop
from retex.operator.metrics import metrics_ledger
from retex.operator.metrics import serve as serve_metrics
from retex.operator.mirror import StatusMirror
from retex.operator.reaper import Reaper
from retex.operator.settings import LiveWorkerDefaults, OperatorSettings, session_limits
from retex.operator.witness import behind, shown_version

log = logging.getLogger(__name__)
TASKS = (GROUP, VERSION, PLURAL)
KOPF_PREFIX = "kopf.retex.dev"
ENDPOINT_RETRY_SECONDS = 10.0  # below the worker's read timeout (retex.worker.ledger_client)
POSTGRES_PROBE_SECONDS = 2  # the readiness probe's own timeout is 5 s (manifests/base)
JOB_PROBES = 20  # Jobs of later attempts looked for before a recovery: more would be a dispatch storm


class Runtime:
    """The operator's long-lived parts: one ledger, one API client, and the background loops."""

    def __init__(self, settings: OperatorSettings, *, namespaces: list[str] | None = None):
        # The namespaces this operator serves (RETEX_NAMESPACES; None or empty: every one): a
        # Task elsewhere is another install's, whatever its status shows.
        self._namespaces = set(namespaces or ())
        timing = settings.leader_election
        # The control plane's writes are the leader's: fenced by the ledger's leadership term,
        # which this replica takes when it becomes leader (`_take_term`).
        limits = session_limits(timing)  # a replica frozen in a transaction frees its locks
        self.ledger = Ledger(settings.database_url, limits=limits, leader_fenced=True).open()
        self._term_taken = threading.Event()  # this replica's leadership holds the ledger's term
        self._leaderships = 0  # how many times this replica became leader: a term taker's own
        self._leaderships_lock = threading.Lock()
        self._term_wanted_since: float | None = None  # monotonic: this leadership began without a term
        # Written by the leader alone, as it takes the term (`_take_term`): a standby started with
        # other limits must not override the leader's.
        self._max_running, self._max_running_per_namespace = settings.max_running, settings.max_running_per_namespace
        api = api_client()
        # A ledger another install owns is refused (InstallMismatch) before this replica competes
        # for its leadership term: two installs on one ledger would take it from each other.
        self.ledger.claim_install(uid=install_uid(api, settings.operator_namespace, request_timeout=timing.request_timeout),
                                  namespace=settings.operator_namespace, adopt_from=settings.adopt_ledger)
        self.worker_defaults = LiveWorkerDefaults(settings.worker, settings.ledger_tls)
        self._wedge_floor = settings.loop_wedge_floor_seconds
        pod = os.environ.get("POD_NAME") or socket.gethostname()  # this replica
        self.kube = KubeCalls(api, instance=pod, request_timeout=timing.request_timeout, may_write=self.may_write)
        self.leases = LeaseObserver(api)
        self.pods = PodEndings(api)
        self.relay = Relay(self.ledger, self.kube, self.worker_defaults, interval=settings.relay_interval_seconds,
                           claim_seconds=timing.request_timeout, defer_limit_seconds=settings.dispatch_defer_limit_seconds,
                           failpoints_from_annotations=settings.failpoints_from_annotations)
        retention = settings.history_retention_days
        self.retention_days = retention
        # What each namespace may keep in the ledger: a Task past it is refused at admission.
        self.quota = NamespaceQuota(max_tasks=settings.namespace_max_tasks,
                                    max_result_bytes=settings.namespace_max_result_bytes)
        self.promoter = Promoter(self.ledger, self.relay, retention_seconds=retention * 86400 if retention else None)
        self.reaper = Reaper(self.ledger, self.kube, self.leases, self.pods, interval=settings.reaper_interval_seconds,
                             start_deadline_seconds=settings.worker_start_deadline_seconds,
                             on_replaced=self.relay.wake.set)
        self.mirror = StatusMirror(self.ledger, self.kube, self.leases, resync_seconds=settings.resync_seconds)
        # Workers' calls get a ledger of their own: a short Postgres retry window, so an outage is
        # answered 503 (the worker retries) before the worker's request times out.
        self.worker_ledger = Ledger(settings.database_url, max_connections=8, retry_for_seconds=ENDPOINT_RETRY_SECONDS,
                                    limits=limits).open(migrate_schema=False)
        self.endpoint = ledger_endpoint.LedgerEndpoint(self.worker_ledger, WorkerIdentities(api))
        # And the metrics scrape another: a scrape during an outage answers within seconds, with
        # retex_ledger_up 0, rather than failing the whole page (retex.operator.metrics).
        self.metrics_ledger = metrics_ledger(settings.database_url).open(migrate_schema=False)
        # Unique per process (client-go's hostname + UUID): a restarted container is a new
        # candidate, never mistaken for the leader it replaces.
        identity = f"{pod}_{uuid.uuid4().hex[:8]}"
        self.leadership = Leadership(
            LeaderLease(api, settings.operator_namespace),
            identity, timing, on_started=self._lead, may_keep=self._may_keep_lease)
        self._writers = [self.relay, self.promoter, self.reaper, self.mirror, self.mirror.resync, self.mirror.events]
        for loop in self._writers:
            loop.may_write = self.may_write
            loop.on_not_leader = self._term_lost
        self._loops: list[LeaseObserver | PodEndings | Loop] = [self.leases, self.pods, *self._writers]
        self._threads = [
            threading.Thread(target=fn, name=name, daemon=True)
            for name, fn in [("lease-watch", self.leases.run), ("pod-watch", self.pods.run), ("relay", self.relay.run),
                             ("promoter", self.promoter.run), ("reaper", self.reaper.run),
                             ("status-mirror", self.mirror.run), ("status-resync", self.mirror.resync.run),
                             ("event-poster", self.mirror.events.run),
                             ("ledger-listen", self.listen)]
        ]
        self._election_thread = threading.Thread(target=self.leadership.run, name="leader-election", daemon=True)

    def may_write(self) -> bool:
        """Whether this replica writes as the leader now: it leads (on its own clock) and has taken
        the ledger's leadership term for this leadership."""
        return self._term_taken.is_set() and self.leadership.leading()

    async def until_writing(self) -> None:
        """For kopf's handlers: return once this replica may write (a standby's handler waits here,
        so kopf writes nothing for it: no progress annotation, no diff base)."""
        while not self.may_write():
            await asyncio.sleep(self.leadership.timing.retry_period / 2)

    def _lead(self) -> None:
        """This replica just became leader: it relists and judges every worker afresh, and takes
        the ledger's term; its writers start once it has. In a thread of its own: taking the term
        waits for the predecessor's transactions under way (the server ends a frozen one's after
        the renew deadline), and the election thread must go on renewing meanwhile."""
        with self._leaderships_lock:
            self._term_taken.clear()
            self._leaderships += 1
            leadership = self._leaderships
            self._term_wanted_since = time.monotonic()
        self.leases.grant_grace()
        self.mirror.take_over()
        threading.Thread(target=self._take_term, args=(leadership,), name="ledger-term", daemon=True).start()

    def _term_lost(self, refused: NotLeader) -> None:
        """A writer's write was refused NotLeader for the term this replica holds: the ledger's term
        moved on. (A refusal of an earlier term — a writer under way when the leadership restarted
        — changes nothing.) Its writers stop, and its leadership restarts (Leadership.restart): a
        new term is taken only after a Lease write proved this replica still holds the Lease,
        never on its own clock alone, which a host suspend can stop, and which two installs
        sharing one database would each trust. (restart outside this lock: `_lead` runs under the
        election's lock and takes this one.)"""
        with self._leaderships_lock:
            if not self._term_taken.is_set() or refused.term != self.ledger.term:
                return  # not taken yet, an earlier term's refusal, or another writer's is being handled
            self._term_taken.clear()
        log_line(log, logging.ERROR, "ledger term lost while leading: restarting the leadership",
                 identity=self.leadership.identity, term=refused.term, why=str(refused))
        self.leadership.restart()

    def _take_term(self, leadership: int) -> None:
        """Take the ledger's term for this replica's `leadership`-th leadership. Whether it still
        leads is asked again under the term's row lock (Ledger.take_term), so a replica deposed
        meanwhile takes none after its successor's; a taker left over from an earlier leadership
        of this replica's stops, and never marks the term taken for a later one. While this
        leadership does not lead the taker waits, up to a lease duration, rather than quit: a
        renewal sent before the renew deadline and answered after it continues the leadership
        (the election judges a RENEW by when it began), and that leadership must not go on
        without a term."""

        def current() -> bool:
            return leadership == self._leaderships and self.leadership.leading()

        lapsed_since: float | None = None
        while leadership == self._leaderships:
            if not self.leadership.leading():
                lapsed_since = time.monotonic() if lapsed_since is None else lapsed_since
                if time.monotonic() - lapsed_since > self.leadership.timing.lease_duration:
                    log_line(log, logging.WARNING, "ledger term not taken: this leadership ended")
                    return
                time.sleep(self.leadership.timing.retry_period)
                continue
            lapsed_since = None
            try:
                term = self.ledger.take_term(lock_timeout_seconds=self.leadership.timing.retry_period,
                                             still_leading=current)
                if not self._witnessed(current):
                    continue
                # This leader's run limits, under its term, before any of its writers places a task.
                self.ledger.set_run_limits(max_running=self._max_running,
                                           max_running_per_namespace=self._max_running_per_namespace)
            except NotLeader as exc:
                log_line(log, logging.WARNING, "ledger term not taken: not leading at the moment", error=str(exc))
                continue
            except Exception as exc:  # the predecessor's transaction still holds the term, or Postgres is away
                log_line(log, logging.WARNING, "ledger term not taken yet: trying again",
                         error=f"{type(exc).__name__}: {exc}")
                time.sleep(self.leadership.timing.retry_period)
                continue
            with self._leaderships_lock:  # checked and marked at once: `_lead` clears it under this lock
                if leadership != self._leaderships:
                    return  # a later leadership's own taker takes a newer term
                self._term_taken.set()
                self._term_wanted_since = None
            log_line(log, logging.INFO, "ledger term taken: this replica writes as the leader", term=term,
                     identity=self.leadership.identity)
            for loop in self._writers:
                loop.wake.set()
            return

    def _witnessed(self, current: Callable[[], bool]) -> bool:
        """Before any writer of this leadership runs: every Task whose status shows more than the
        ledger holds is frozen (the status resync's pass), so no dispatch or attempt goes out from
        a ledger that was restored or failed over while no leader watched. Tried again until it
        passes or the leadership ends (False): a leader that cannot read its Tasks gives up its
        Lease after a lease duration without the term (`_may_keep_lease`)."""
        while current():
            try:
                self.mirror.mark_behind(lost=self._judge_lost)
                return True
            except NotLeader:
                raise  # the term moved on meanwhile: taken again
            except Exception as exc:
                log_line(log, logging.WARNING, "the Tasks could not be compared with the ledger yet: trying again",
                         error=f"{type(exc).__name__}: {exc}")
                time.sleep(self.leadership.timing.retry_period)
        return False

    def _judge_lost(self, task: dict[str, Any]) -> None:
        """A Task whose status shows the ledger held it, which the ledger does not hold, judged
        before kopf admits anything: a Task resubmitted with its idempotencyKey while the ledger
        was away is then the duplicate, not the lost one."""
        meta = task["metadata"]
        if self._namespaces and meta["namespace"] not in self._namespaces:
            return  # another install's Task: its ledger is not this one
        try:
            admission = admission_for(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"],
                                      spec=task.get("spec") or {},
                                      submitted_at=datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00")))
        except pydantic.ValidationError:
            return  # admission refuses it, as it would any Task whose spec the models refuse
        _admit_lost(self.ledger, admission, task, log, uid=meta["uid"], namespace=meta["namespace"], name=meta["name"])

    def _waiting_for_term(self) -> float | None:
        """How long this leadership has gone without the ledger's term (None: it holds it, or this
        replica does not lead)."""
        since = self._term_wanted_since
        if since is None or self._term_taken.is_set() or not self.leadership.leading():
            return None
        return time.monotonic() - since

    def _may_keep_lease(self) -> bool:
        """The election asks before each renewal: a leader that went a lease duration without the
        ledger's term (Postgres away from it, an old leader's long transaction holding the term's
        row) gives the Lease up, so a standby that can take the term leads (retex.operator.health)."""
        return not term_overdue(self._waiting_for_term(), lease_duration=self.leadership.timing.lease_duration)

    def listen(self) -> None:
        """Ledger changes mark the task for the status mirror and wake the relay: a worker that
        completes a task may have started a queued one, whose Job should not wait for a poll."""
        self.mirror.listen(on_change=self._changed)

    def _changed(self) -> None:
        self.relay.wake.set()
        self.promoter.wake.set()  # a worker may have scheduled a retry due sooner than its sleep

    def start(self, metrics_port: int | None, ledger_port: int, ledger_tls: ledger_endpoint.LedgerTls | None) -> None:
        if metrics_port:
            serve_metrics(self.metrics_ledger, metrics_port)
        self._endpoint_server = ledger_endpoint.serve(self.endpoint, ledger_port, ledger_tls)
        for thread in self._threads:
            thread.start()
        self._election_thread.start()

    def _dead_threads(self) -> list[str]:
        return [thread.name for thread in [*self._threads, self._election_thread] if not thread.is_alive()]

    def _loop_states(self) -> list[LoopState]:
        return [LoopState(loop.name, loop.period, loop.round_started_at, loop.last_pass_at) for loop in self._writers]

    def ready(self) -> Verdict:
        """The readiness probe's answer (retex.operator.health)."""
        try:
            self.worker_ledger.ping(timeout=POSTGRES_PROBE_SECONDS)
            postgres_error = None
        except Exception as exc:
            postgres_error = f"{type(exc).__name__}: {exc}"
        return readiness(postgres_error=postgres_error, dead_threads=self._dead_threads(),
                         endpoint_serving=self._endpoint_server.serving_thread.is_alive(),
                         leading=self.leadership.leading(), loops=self._loop_states(), now=time.monotonic(),
                         waiting_for_term=self._waiting_for_term(),
                         lease_duration=self.leadership.timing.lease_duration)

    def live(self) -> Verdict:
        """The liveness probe's answer: Postgres is not asked (retex.operator.health)."""
        return liveness(dead_threads=self._dead_threads(), loops=self._loop_states(), now=time.monotonic(),
                        wedge_floor=self._wedge_floor)

    def stop(self) -> None:
        for loop in self._loops:
            loop.stop()
        for thread in self._threads:
            thread.join(timeout=5)
        self.leadership.stop()  # after the writers: a successor starts only once they are done
        self._election_thread.join(timeout=5)
        self._endpoint_server.shutdown()
        self._endpoint_server.server_close()
        self.worker_ledger.close()
        self.metrics_ledger.close()
        self.ledger.close()


class ReducedDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base (its last-handled-configuration annotation) holding only what a handler
    reacts to after creation: `spec.cancel` (the rest of the spec is immutable by CRD rule) and
    the requeue, resolve and recover annotations. kopf's default keeps the whole spec and every annotation, JSON with
    non-ASCII escaped: a payload under its 64 KiB limit took up to 6 bytes a character there, next
    to kubectl apply's own copy, and the object outgrew the API server's 256 KiB annotation limit
    — no patch landed again, so the Task could not even be deleted."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        essence = super().build(body=body, extra_fields=extra_fields)
        reduced: dict[str, Any] = {}
        if "cancel" in (essence.get("spec") or {}):
            reduced["spec"] = {"cancel": essence["spec"]["cancel"]}
        annotations = (essence.get("metadata") or {}).get("annotations") or {}
        kept = {key: annotations[key] for key in (REQUEUE_ANNOTATION, RESOLVE_ANNOTATION, RECOVER_ANNOTATION)
                if key in annotations}
        if kept:
            reduced["metadata"] = {"annotations": kept}
        return cast(kopf.BodyEssence, reduced)


def leader_only(handler: Callable[..., Any]) -> Callable[..., Any]:
    """The kopf handler runs (in a thread, as a sync handler would) once this replica leads.
    Named as the handler (kopf's handler id, in its progress annotations) but not
    functools.wraps: kopf follows __wrapped__ and would call the sync handler directly."""

    async def when_leading(**kwargs: Any) -> Any:
        runtime = kwargs["memo"].runtime
        while True:
            await runtime.until_writing()
            try:
                return await asyncio.to_thread(functools.partial(handler, **kwargs))
            except STOPPED_LEADING as exc:
                # It stopped leading meanwhile. Raising (even kopf.TemporaryError) would have kopf
                # patch its progress onto the Task as a deposed leader: wait instead. kopf, stopped
                # meanwhile, cancels this (nothing written); the next leader's kopf resumes the Task.
                log_line(kwargs["logger"], logging.INFO, "handler waits: this replica stopped leading",
                         handler=handler.__name__, error=str(exc))
                if isinstance(exc, NotLeader):  # as a writer loop's refusal does (Loop.on_not_leader)
                    await asyncio.to_thread(runtime._term_lost, exc)
                await asyncio.sleep(runtime.leadership.timing.retry_period)

    when_leading.__name__, when_leading.__qualname__ = handler.__name__, handler.__qualname__
    when_leading.__module__, when_leading.__doc__ = handler.__module__, handler.__doc__
    return when_leading


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = "retex.dev/finalizer"
    # A prefix of kopf's own: kopf drops every annotation under its storage prefixes from the
    # diffs it computes, so under plain retex.dev the requeue annotation would never be seen.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = ReducedDiffBaseStorage(prefix=KOPF_PREFIX)
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.watching.inactivity_timeout = 330
    settings.networking.request_timeout = 30


@kopf.on.resume(*TASKS)
@kopf.on.create(*TASKS)
@leader_only
def admit(uid: str, namespace: str, name: str, spec: kopf.Spec, meta: kopf.Meta, body: kopf.Body,
          memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Into the ledger with its first dispatch, in one transaction; idempotent by UID (R1).

    Refused instead (Accepted=False, phase Refused, never run): a spec the models refuse,
    annotations leaving no room for the operator's own, a Job the API server would refuse (a
    server-side dry run of attempt 1's Job; NamespaceNotOnboarded when RBAC refuses it: no
    RoleBinding for the operator there), a duplicate idempotencyKey. A refusal is stored in
    the ledger and final: this handler also runs at every operator start (kopf's resume), and
    must not decide again (a dry run that passes now, a key a purge would otherwise free)."""
    runtime: Runtime = memo.runtime
    failpoint("before-admit", task=name, uid=uid)  # crash-matrix R1: the Task exists, the ledger row does not
    try:
        held: TaskRecord | None = runtime.ledger.get(uid)
    except TaskNotFound:
        held = None
    if held is not None:  # resumed after a restart: checked when it was admitted; unless the ledger went back
        if held.frozen_reason is not None:  # a person decides; a cancel made since is the cancel handler's
            runtime.mirror.mark(uid)
            return
        if behind(dict(body), held.version):
            runtime.mirror.freeze(dict(body), held.version)
            return
    elif not _admitted_now(runtime, uid=uid, namespace=namespace, name=name, spec=dict(spec),
                           meta=meta, body=dict(body), logger=logger):
        return
    if spec.get("cancel"):
        runtime.ledger.request_cancel(uid)
    runtime.relay.wake.set()
    runtime.promoter.wake.set()
    runtime.mirror.mark(uid)


def _admitted_now(runtime: Runtime, *, uid: str, namespace: str, name: str, spec: dict[str, Any],
                  meta: kopf.Meta, body: dict[str, Any], logger: kopf.Logger) -> bool:
    """Admit a Task the ledger does not hold; False when it is not admitted (refused or purged).
    Every final decision the ledger already holds is asked first, before the dry run. `logger`:
    kopf's for this Task, whose lines name it (uid, namespace, name: retex.logs)."""

    def refuse(reason: str, message: str) -> bool:
        stored = runtime.ledger.refuse(Refusal(uid=uid, namespace=namespace, name=name, reason=reason,
                                               message=message, generation=meta.get("generation")))
        runtime.mirror.refuse(body, stored.reason, stored.message)
        return False

    earlier = runtime.ledger.refusal(uid)
    if earlier is not None:
        runtime.mirror.refuse(body, earlier.reason, earlier.message)
        return False
    if (body.get("status") or {}).get("phase") == REFUSED:  # a refusal the ledger lost (restored, failed over)
        return refuse(*_shown_refusal(body))
    try:
        submitted_at = datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
        admission = admission_for(uid=uid, namespace=namespace, name=name, spec=spec, submitted_at=submitted_at)
    except pydantic.ValidationError as refused:
        return refuse("InvalidSpec", invalid_spec_message(refused))
    too_large = annotations_refusal(dict(meta.get("annotations") or {}), own_prefix=KOPF_PREFIX)
    if too_large:
        return refuse("AnnotationsTooLarge", too_large)
    if behind(body, None):  # its status shows the ledger held it: never admitted as new (retex.operator.witness)
        verdict = _admit_lost(runtime.ledger, admission, body, logger)
        if verdict is None:
            runtime.mirror.mark(uid)
            return False
        # else a final decision stands for its uid: judged below, as ever
    else:
        verdict = runtime.ledger.prior_verdict(admission)
    if verdict is None:
        job = build_job(task_name=name, task_uid=uid, namespace=namespace, epoch=1,
                        spec=TaskSpec.model_validate(admission.spec), defaults=runtime.worker_defaults())
        try:
            runtime.kube.dry_run_job(job)
        except NotPermitted as refused:
            return refuse(NAMESPACE_NOT_ONBOARDED, not_onboarded_message(namespace, refused.message))
        except Refused as refused:
            return refuse("JobRejected", f"the API server refuses its Job: {refused.message}")
        except Exception as exc:  # 429, 5xx, unreachable: not the Task's fault; kopf retries
            raise kopf.TemporaryError(f"dry run of the Job failed: {exc}", delay=5) from exc
        verdict = runtime.ledger.admit(admission, quota=runtime.quota)
        failpoint("after-admit", task=name, uid=uid)  # crash-matrix R2: ledger row and dispatch committed, no Job yet
    if verdict.refusal is not None:
        runtime.mirror.refuse(body, verdict.refusal.reason, verdict.refusal.message)
        return False
    if verdict.purged:  # it ran to its end long ago and its history was purged: never again
        log_line(logger, logging.INFO, "purged by history retention: not admitted again")
        return False
    if verdict.duplicate_of is not None:
        first = verdict.duplicate_of
        log_line(logger, logging.INFO, "duplicate by idempotencyKey: not run", duplicate_of=first.uid)
        return refuse("DuplicateIdempotencyKey",
                      f"idempotencyKey {admission.idempotency_key!r} was already used by Task "
                      f"{first.namespace}/{first.name} (uid {first.uid}); this one is not run")
    if verdict.over_quota is not None:  # final once stored, as every refusal: not admitted when room frees
        return refuse(QUOTA_EXCEEDED, quota_message(verdict.over_quota, retention_days=runtime.retention_days))
    return True


def _admit_lost(ledger: Ledger, admission: TaskAdmission, task: dict[str, Any],
                logger: logging.Logger | logging.LoggerAdapter[Any], **who: Any) -> AdmitResult | None:
    """A Task whose status shows the ledger held it, which the ledger does not hold: into the
    ledger frozen (LedgerLost), said at ERROR, and None; or the final decision that stands for its
    uid (purged, refused). `who`: the fields naming the Task, where `logger` does not add them."""
    lost = ledger.admit_lost(admission, witness=task.get("status") or {}, shown_version=shown_version(task) or 0)
    if isinstance(lost, TaskRecord):
        log_line(logger, logging.ERROR, "task frozen: the ledger holds nothing of a Task whose status showed it",
                 **who, shown_version=shown_version(task), phase=(task.get("status") or {}).get("phase"))
        return None
    return lost


def _shown_refusal(body: dict[str, Any]) -> tuple[str, str]:
    """The refusal a Task's status showed (its Accepted=False condition): it stands."""
    status = body.get("status") or {}
    accepted = find_condition(TaskStatus.model_validate(status).conditions, ConditionType.ACCEPTED) if status else None
    if accepted is not None and accepted.status == "False":
        return accepted.reason, accepted.message
    return "Refused", "refused before the ledger lost the refusal; it stands"


@kopf.on.field(*TASKS, field="spec.cancel", new=True)
@leader_only
def cancel(uid: str, memo: kopf.Memo, **_: Any) -> None:
    """A waiting task ends now; a running one at its worker's next step boundary, or at once
    (the reaper) when no worker holds its lease."""
    try:
        memo.runtime.ledger.request_cancel(uid)
    except TaskNotFound:
        return  # refused at admission (e.g. a duplicate idempotencyKey) or purged: never in the ledger
    memo.runtime.reaper.wake.set()


def _actor(body: kopf.Body, new: str) -> str:
    """Who asked: the requested-by annotation (the API server checked it is the user who set it,
    manifests/base/requested-by-policy.yaml), else the annotation's value as before."""
    user = (body.get("metadata", {}).get("annotations") or {}).get(REQUESTED_BY_ANNOTATION)
    return f"kube:{user}" if user else f"annotation:{new}"


@kopf.on.field(*TASKS, field=("metadata", "annotations", REQUEUE_ANNOTATION))
@leader_only
def requeue(uid: str, new: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Setting (or changing) the annotation gives a Failed or NeedsAttention task a fresh attempt
    and budget; the ledger records it in history, with who asked."""
    runtime: Runtime = memo.runtime
    if new:
        try:
            runtime.ledger.requeue(uid, actor=_actor(body, new))
        except IllegalTransition as refused:  # not Failed or NeedsAttention, or a step awaits a human
            log_line(logger, logging.WARNING, "requeue refused", why=str(refused))
            runtime.mirror.warn(dict(body), "RequeueRefused", f"requeue refused: {refused}")
            return
        except TaskNotFound:  # not in the ledger: retrying (kopf's default) would loop for ever
            refusal = runtime.ledger.refusal(uid)
            why = (f"the Task was refused at admission ({refusal.reason}), it never runs" if refusal else
                   "the Task's history was purged (history retention), it never runs again")
            log_line(logger, logging.WARNING, "requeue ignored", why=why)
            runtime.mirror.warn(dict(body), "RequeueIgnored", f"requeue ignored: {why}; create a new Task")
            return
        runtime.relay.wake.set()


@kopf.on.field(*TASKS, field=("metadata", "annotations", RESOLVE_ANNOTATION))
@leader_only
def resolve(uid: str, new: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """`retex resolve` through the API: the annotation holds the decision as JSON
    ({"step", "markDone", "result"?, "requestedAt"}); the ledger records it with who asked."""
    runtime: Runtime = memo.runtime
    if not new:
        return
    try:
        decision = json.loads(new)
        step, mark_done = decision["step"], decision["markDone"]
        if not isinstance(step, str) or not isinstance(mark_done, bool):
            raise TypeError("step must be a string and markDone a boolean")
    except (ValueError, KeyError, TypeError) as bad:
        runtime.mirror.warn(dict(body), "ResolveIgnored", f"resolve ignored: the annotation {RESOLVE_ANNOTATION} "
                            f"is not a decision ({bad}); use `retex resolve`")
        return
    try:
        runtime.ledger.resolve_step(uid, step, mark_done=mark_done, result=decision.get("result"),
                                    actor=_actor(body, new))
    except (LedgerUnavailable, NotLeader):
        raise  # kopf retries the handler
    except (IllegalTransition, LedgerError) as refused:  # a step not awaiting a decision, a result too large
        log_line(logger, logging.WARNING, "resolve refused", why=str(refused))
        runtime.mirror.warn(dict(body), "ResolveRefused", f"resolve of step {step!r} refused: {refused}")
        return
    runtime.relay.wake.set()
    runtime.mirror.mark(uid)


@kopf.on.field(*TASKS, field=("metadata", "annotations", RECOVER_ANNOTATION))
@leader_only
def recover(uid: str, new: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """`retex recover` through the API: the annotation holds the decision for a frozen task as
    JSON ({"mode": "from-status" | "afresh", "requestedAt"}); the ledger records it with who asked."""
    runtime: Runtime = memo.runtime
    if not new:
        return
    try:
        mode = json.loads(new)["mode"]
        if mode not in RECOVER_MODES:
            raise ValueError(f"mode must be one of {', '.join(RECOVER_MODES)}")
    except (ValueError, KeyError, TypeError) as bad:
        runtime.mirror.warn(dict(body), "RecoverIgnored", f"recover ignored: the annotation {RECOVER_ANNOTATION} "
                            f"is not a decision ({bad}); use `retex recover`")
        return
    try:
        runtime.ledger.recover(uid, from_status=mode == "from-status", actor=_actor(body, new),
                               min_epoch=_last_epoch_seen(runtime, dict(body)))
    except (NotFrozen, TaskNotFound) as refused:
        log_line(logger, logging.WARNING, "recover refused", why=str(refused))
        runtime.mirror.warn(dict(body), "RecoverRefused", f"recover refused: {refused}")
        return
    log_line(logger, logging.INFO, "frozen task recovered", mode=mode, actor=_actor(body, new))
    runtime.relay.wake.set()
    runtime.mirror.mark(uid)


def _last_epoch_seen(runtime: Runtime, body: dict[str, Any]) -> int:
    """The highest attempt the cluster knows of the task, which its ledger may have forgotten: the
    one its status showed, its Lease's holder's, and each Job of a later attempt that still exists
    (an attempt dispatched after the status was last written). A recovered task's next attempt
    comes after it, so no Job of its name is met as already there (AlreadyExists is success)."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    epoch = int((body.get("status") or {}).get("attempt") or 0)
    lease = runtime.leases.get(namespace, lease_name(name, uid), uid)
    if lease is not None and lease.holder_epoch:
        epoch = max(epoch, lease.holder_epoch)
    for _ in range(JOB_PROBES):
        if runtime.kube.get_job(namespace, job_name(name, uid, epoch + 1)) is None:
            break
        epoch += 1
    return epoch


@kopf.on.delete(*TASKS)
@leader_only
def deleted(uid: str, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer holds deletion until the task is terminal: ended at once (TaskDeleted) when
    waiting or when no worker holds its lease (the reaper: a pod that never started, a namespace
    being deleted), at its worker's next step boundary when running. The ledger keeps its history
    (see the retention setting); owner references then take the Job and Lease away."""
    runtime: Runtime = memo.runtime
    try:
        record = runtime.ledger.request_cancel(uid, reason="TaskDeleted")
    except TaskNotFound:
        return  # refused at admission (never in the ledger), or purged
    if not record.terminal:
        runtime.reaper.wake.set()
        raise kopf.TemporaryError("waiting for the worker to stop at a step boundary", delay=2)
