"""The status mirror: every Task.status write, from the ledger.

One module owns it so the rules hold in one place: status is a pure function of committed ledger
state plus the lease as observed (retex.operator.status); it is written only when its ledger
version is newer than the one shown (the CRD's CEL rule refuses an older one anyway); bursts of
NOTIFY coalesce into one write per task; a periodic resync, on a loop of its own, repairs anything
missed, including after restarts; the Events a status change makes are posted on a loop of their
own (retex.operator.events), which no status write waits for.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from retex.api import REFUSED, ConditionType, ShownPhase, TaskStatus, find_condition, set_condition
from retex.failpoints import failpoint
from retex.kube.errors import api_message, transient
from retex.kube.leasewatch import LeaseObserver
from retex.kube.objects import lease_name
from retex.kube.operator_calls import EventNotPosted, KubeCalls, NotLeading, StatusNotWritten
from retex.ledger import Ledger, LedgerError, TaskNotFound, TaskRecord
from retex.logs import log_line
from retex.machine import TaskPhase
from retex.operator.events import EventLimiter, EventPoster
from retex.operator.loop import Loop
from retex.operator.metrics import MIRROR_LAG, MIRROR_PENDING, count_failure
from retex.operator.status import (
    DEAD_LETTER_LABEL,
    FINAL_EVENTS,
    as_merge_patch,
    compute_status,
    events_between,
    in_fair_order,
    labelled_dead,
)
from retex.operator.witness import behind, frozen_status, recovered_conditions, shown_version

log = logging.getLogger(__name__)

# The NOTIFY listener, after a failure, listens again after this, doubling up to the max.
LISTEN_RETRY_FIRST_SECONDS = 0.5
LISTEN_RETRY_MAX_SECONDS = 30.0
# A task whose status write failed (not as stale: a 403, a 422 of another rule, a 500) is tried
# again after this, doubling up to the max; the other tasks' writes do not wait for it.
WRITE_RETRY_FIRST_SECONDS = 1.0
WRITE_RETRY_MAX_SECONDS = 60.0
# A round's writes go out this many at a time: each is several round trips to the API server, and
# one after another a change waits for the whole round before it (docs/operator.md, status lag).
# controller-runtime's MaxConcurrentReconciles, for the same reason.
WRITERS = 4
# Tasks written per round, two writes per writer: marks made meanwhile are ordered with the rest at
# the next round, so a backlog (thousands of first statuses) holds up a task doing something by
# about two writes. Tasks held back (`_held_back`) take no place in a round.
WRITE_BATCH = 2 * WRITERS
# A task's status is written at most once this often while its phase stays the same: a task of
# many quick steps moves its ledger version at every step, and a dashboard needs no more. A phase
# change is written at once.
SAME_PHASE_WRITE_FLOOR_SECONDS = 1.0


class StatusResync(Loop):
    """Every `period` seconds, mark every Task whose status lags the ledger (`StatusMirror.mark_behind`).
    A loop of its own: its LIST of every Task takes seconds at scale, and no status write waits
    for it."""

    name = "status-resync"

    def __init__(self, mark_behind: Callable[[], None], *, period: float):
        super().__init__()
        self._mark_behind, self.period = mark_behind, period

    def round(self) -> float:
        self._mark_behind()
        return self.period



class StatusMirror(Loop):
    """Writes Task.status from the ledger, driven by NOTIFY, with a periodic resync (`resync`) and
    the Events of what changed posted (`events`): two loops the Runtime runs beside this one."""

    name = "status-mirror"
    COALESCE_SECONDS = 0.1  # NOTIFY bursts within this window become one write per task
    period = COALESCE_SECONDS

    def __init__(self, ledger: Ledger, kube: KubeCalls, leases: LeaseObserver, *, resync_seconds: float,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._ledger, self._kube, self._leases, self._clock = ledger, kube, leases, clock
        self.resync = StatusResync(self.mark_behind, period=resync_seconds)
        self.events = EventPoster(kube, clock=clock)
        self._dirty: set[str] = set()
        self._marked_at: dict[str, float] = {}  # first unwritten mark per task: the mirror's lag
        self._retry: dict[str, tuple[float, float]] = {}  # uid -> (not before, next delay) after a failed write
        self._written: dict[str, tuple[float, TaskPhase]] = {}  # uid -> when and in which phase this mirror last wrote it
        self._lock = threading.Lock()
        self._limiter = EventLimiter()
        MIRROR_PENDING.set_function(self.oldest_pending_seconds)

    def oldest_pending_seconds(self) -> float:
        """How long the oldest mark not yet settled (written, or found nothing to write) has waited,
        since this replica last took over at the latest. 0 on a standby: it writes nothing by design."""
        with self._lock:
            oldest = min(self._marked_at.values(), default=None)
        return 0.0 if oldest is None or not self.may_write() else self._clock() - oldest

    def _settled(self, uid: str) -> float | None:
        """The mark of `uid` needs no more writing: when it was made."""
        with self._lock:
            self._retry.pop(uid, None)
            return self._marked_at.pop(uid, None)

    def mark(self, uid: str) -> None:
        # A standby keeps no marks (the ledger-listen thread runs on every replica): taking over
        # marks every Task whose status lags anyway (`take_over`), and a standby's marks
        # would pile up for as long as it waits, and show as old changes the moment it leads.
        if not self.may_write():
            return
        with self._lock:
            self._dirty.add(uid)
            self._marked_at.setdefault(uid, self._clock())

    def listen(self, on_change: Callable[[], None]) -> None:
        """Thread: turn NOTIFY into dirty marks (the write loop coalesces them). Supervised: any
        error (Postgres restarted, the backend terminated, a payload it cannot read, a bug) is
        logged and counted, and it listens again after a backoff; once it listens again, the resync
        runs at once, for the changes nobody heard meanwhile."""
        delay = LISTEN_RETRY_FIRST_SECONDS
        missed = False  # changes may have gone unheard: resync once listening again
        while not self.stopping:
            try:
                for change in self._ledger.listen(timeout=0.5):
                    if self.stopping:
                        return
                    if missed:  # the first yield comes after LISTEN: a change from now on is heard
                        self.resync.wake.set()
                        missed = False
                    delay = LISTEN_RETRY_FIRST_SECONDS  # listening again: the next fault starts over
                    if change is not None:
                        self.mark(change[0])
                        on_change()
            except Exception as exc:
                count_failure("ledger-listen", exc)
                log_line(log, logging.WARNING, "ledger listen failed; listening again", error=f"{type(exc).__name__}: {exc}",
                         retry_in_seconds=round(delay, 1))
                self._stop.wait(delay)
                delay = min(delay * 2, LISTEN_RETRY_MAX_SECONDS)
                missed = True

    def take_over(self) -> None:
        """This replica now leads. Mark every lagging Task at the resync's next round, now (what it
        saw as a standby it did not write). Marks kept from an earlier leadership of this replica
        wait from now: the pending gauge says how long this leader has not written a change, not
        how long it stood by. Events queued in an earlier leadership are dropped (`EventPoster.forget`)."""
        now = self._clock()
        with self._lock:
            # Only what is still marked: a mark re-made when the last leadership ended was dropped
            # (`mark` on a standby), and its first mark's time would show as pending for ever.
            self._marked_at = dict.fromkeys(self._dirty, now)
            self._retry = {uid: retry for uid, retry in self._retry.items() if uid in self._dirty}
        self.events.forget()
        self.resync.wake.set()

    def run(self) -> None:
        super().run()
        self.events.drain()  # stopping: the last round's writes have queued their Events

    def round(self) -> float:
        """Write the dirty tasks that may be written now (`_held_back`), the first `WRITE_BATCH` in
        order (`_in_order`) when there are more, `WRITERS` at a time. At once again while more remain."""
        with self._lock:
            marked, self._dirty = self._dirty, set()
        unwritten, pending = set(marked), []
        try:
            held = self._held_back(marked)
            pending = [uid for uid in marked if uid not in held]
            if len(pending) > WRITE_BATCH:  # all are written this round otherwise: no order to ask the ledger for
                pending = self._in_order(pending)
            self._write(pending[:WRITE_BATCH], unwritten)
        finally:
            for uid in unwritten:  # a failed, full or held-back round loses no mark: a next one takes them
                self.mark(uid)
        return 0.0 if len(pending) > WRITE_BATCH else self.COALESCE_SECONDS

    def _held_back(self, marked: set[str]) -> set[str]:
        """The marked tasks not to write this round, nor to count in its batch: one waiting out its
        backoff after a failed write, and one this mirror wrote less than
        `SAME_PHASE_WRITE_FLOOR_SECONDS` ago whose ledger phase is still the one written (a phase
        change, even one made while it was held back, is written at once)."""
        now = self._clock()
        with self._lock:
            self._written = {uid: last for uid, last in self._written.items()
                             if now - last[0] < SAME_PHASE_WRITE_FLOOR_SECONDS}
            backing_off = {uid for uid in marked if uid in self._retry and now < self._retry[uid][0]}
            recent = {uid: self._written[uid][1] for uid in marked - backing_off if uid in self._written}
        phases = self._ledger.phases_of(list(recent)) if recent else {}
        return backing_off | {uid for uid, written in recent.items() if uid in phases and phases[uid][1] == written}

    def _write(self, batch: list[str], unwritten: set[str]) -> None:
        """Mirror each task of `batch` (distinct uids), `WRITERS` at a time, the first ones first, and
        take out of `unwritten` each one done (written, or kept on its own by `_mirror_on_its_own`).
        What fails for every task, or the loop stopping, starts no more of them; the error is raised
        once the writes in flight have ended, so no two rounds ever write the same task at once."""
        queue, taking = iter(batch), threading.Lock()
        errors: list[BaseException] = []

        def writer() -> None:
            while not errors and not self.stopping:
                with taking:
                    uid = next(queue, None)
                if uid is None:
                    return
                try:
                    self._mirror_on_its_own(uid)
                except BaseException as exc:
                    errors.append(exc)
                    return
                unwritten.discard(uid)

        # Daemon threads of the round's own, not a ThreadPoolExecutor: its threads are joined at
        # interpreter exit, and a write in a Postgres outage (the ledger retries for 2 minutes) would
        # hold up the operator's exit after Runtime.stop gave up waiting for this loop.
        threads = [threading.Thread(target=writer, name=f"status-writer-{n}", daemon=True)
                   for n in range(min(WRITERS, len(batch)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _in_order(self, uids: list[str]) -> list[str]:
        """The marked tasks in the order to write them (`in_fair_order`)."""
        phases = self._ledger.phases_of(uids)
        with self._lock:
            marked_at = dict(self._marked_at)
        return in_fair_order(uids, phases, marked_at)

    def _mirror_on_its_own(self, uid: str) -> None:
        """Mirror one task, settled or kept on its own, as the relay settles each record: a write
        that keeps failing for this task (a 403 in a namespace whose RoleBinding was removed, a 422
        of another rule) is retried with backoff and holds up no other task. What fails for every
        task (the ledger, the leadership) fails the round."""
        now = self._clock()
        with self._lock:
            _, delay = self._retry.get(uid, (now, WRITE_RETRY_FIRST_SECONDS))
        try:
            self.mirror(uid)
        except (NotLeading, LedgerError):  # NotLeader is a LedgerError
            raise
        except Exception as exc:
            count_failure(self.name, exc)
            answered = exc if isinstance(exc, ApiException) else None
            # A refusal for good (a status the CRD refuses, a 403) lasts until someone acts; a server
            # error or a dropped connection may clear by itself; anything else is a bug (its
            # traceback logged).
            log_line(log, logging.WARNING if transient(exc) else logging.ERROR, "status write failed; retrying",
                     exc_info=answered is None and not transient(exc), uid=uid, error=type(exc).__name__,
                     http_status=answered.status if answered else None,
                     message=api_message(answered) if answered else str(exc), retry_seconds=delay)
            with self._lock:
                self._retry[uid] = (now + delay, min(delay * 2, WRITE_RETRY_MAX_SECONDS))
            self.mark(uid)

    def refuse(self, task: dict[str, Any], reason: str, message: str) -> None:
        """A Task the operator does not admit (an invalid spec, a Job the API server would refuse,
        a duplicate idempotencyKey ...): never run. Phase Refused and Accepted=False say why.
        Written and announced (a Warning Event) once per generation: admission runs again on
        every operator restart and kopf retry, and shows the refusal the ledger stored again."""
        meta = task["metadata"]
        generation = meta.get("generation")
        shown = TaskStatus.model_validate(task["status"]) if task.get("status") else None
        shown_conditions = shown.conditions if shown else None
        accepted = find_condition(shown_conditions, ConditionType.ACCEPTED)
        announced = (shown is not None and accepted is not None and accepted.status == "False"
                     and accepted.reason == reason and accepted.observed_generation == generation
                     and shown.phase == ShownPhase.REFUSED)
        # A refused task never runs: it has ended, and `kubectl wait --for=condition=Completed`
        # must return for it. One refused by an operator that did not write Completed gets it now.
        if announced and find_condition(shown_conditions, ConditionType.COMPLETED) is not None:
            return
        now = datetime.now(UTC)
        conditions = set_condition(None, ConditionType.ACCEPTED, "False", reason, message,
                                   observed_generation=generation, now=now)
        conditions = set_condition(conditions, ConditionType.COMPLETED, "True", REFUSED, f"{reason}: {message}",
                                   observed_generation=generation, now=now)
        status = TaskStatus(phase=ShownPhase.REFUSED, conditions=conditions, observed_generation=generation)
        self._kube.patch_task_status(meta["namespace"], meta["name"], meta["uid"], as_merge_patch(status))
        if not announced:
            self.warn(task, reason, message)

    def warn(self, task: dict[str, Any], reason: str, message: str) -> None:
        """A Warning Event about the Task that its status does not carry (a refusal, a requeue
        that cannot apply), within the Event limiter."""
        if self._limiter.allow(task["metadata"]["uid"], time.monotonic()):
            try:
                self._kube.post_event(task, reason=reason, message=message, warning=True)
            except EventNotPosted as exc:  # 403 in a namespace not onboarded: the status says it all
                log_line(log, logging.WARNING, "event not posted", uid=task["metadata"]["uid"], reason=reason,
                         http_status=exc.http_status)

    def mark_behind(self, lost: Callable[[dict[str, Any]], None] | None = None) -> None:
        """One LIST: every Task whose shown ledgerVersion lags the ledger, or whose dead-letter
        label disagrees with it (a label patch lost with a leadership), is marked for a write.
        A Task showing a version the ledger has not reached is frozen (`freeze`); one showing a
        version of a task the ledger does not hold at all is handed to `lost` (a leadership's
        first pass judges those before any admission; later passes leave them to admission)."""
        # The first page before the versions: the LIST is a snapshot of when that page was served (the
        # later pages continue it), so a status written meanwhile is never ahead of the versions read.
        # list_tasks pages lazily, and only a page at a time is held (5,000 Tasks at scale).
        pages = self._kube.list_tasks()
        first = next(pages, None)
        ledger_versions, dead = self._ledger.versions(), self._ledger.dead_lettered_uids()
        for task in itertools.chain([first], pages) if first is not None else ():
            uid = task["metadata"]["uid"]
            if uid not in ledger_versions:  # not admitted yet, refused, purged; or lost
                if lost is not None and shown_version(task) is not None:
                    lost(task)
                continue
            if behind(task, ledger_versions[uid]):
                self.freeze(task, ledger_versions[uid])
            elif (shown_version(task) or -1) < ledger_versions[uid] or labelled_dead(task) != (uid in dead):
                self.mark(uid)

    def freeze(self, task: dict[str, Any], ledger_version: int) -> TaskRecord:
        """The ledger is behind what the Task's status showed of it: it lost commits (a failover to
        an asynchronous replica) or was restored from an older backup, and steps it no longer
        records as done would run again. The task is frozen (retex.ledger.witness) and marked:
        its status then says so, with a Warning Event."""
        meta = task["metadata"]
        shown = shown_version(task) or 0
        record = self._ledger.freeze(meta["uid"], reason="LedgerBehind", witness=task.get("status") or {},
                                     shown_version=shown)
        log_line(log, logging.ERROR, "task frozen: the ledger is behind the Task's status", uid=meta["uid"],
                 namespace=meta["namespace"], name=meta["name"], shown_version=shown, ledger_version=ledger_version)
        self.mark(meta["uid"])
        return record

    def mirror(self, uid: str) -> None:
        """Write the status of one task if the ledger is ahead of what the Task shows."""
        try:
            record = self._ledger.get(uid)
        except TaskNotFound:  # purged since it was marked: nothing to show, and no round may stall on it
            self._settled(uid)
            return
        task = self._kube.get_task(record.namespace, record.name)
        if task is None or task["metadata"]["uid"] != uid:
            self._settled(uid)
            return  # deleted (or a newer Task with the same name): nothing to mirror onto
        if record.frozen_reason is None and behind(task, record.version):
            record = self.freeze(task, record.version)
        shown = task.get("status") or {}
        if shown.get("ledgerVersion", -1) >= record.version:
            self._settled(uid)
            # Never write a status older than (or the same as) the one shown; but the label may
            # still lag: its patch after the status write failed, and this is the retry.
            self._label_dead_letter(task, record)
            return
        previous = TaskStatus.model_validate(shown) if shown else None
        lease = self._leases.get(record.namespace, lease_name(record.name, uid), uid)
        generation, now = task["metadata"].get("generation"), datetime.now(UTC)
        if record.frozen_reason is not None:
            status = frozen_status(record, generation=generation, now=now)
        else:
            status = compute_status(record, lease=lease, generation=generation,
                                    previous=recovered_conditions(previous, generation=generation, now=now), now=now)
        failpoint("in-status-mirror", task=record.name, uid=uid)
        try:
            self._kube.patch_task_status(record.namespace, record.name, uid, as_merge_patch(status))
        except StatusNotWritten as exc:  # gone, replaced, or a newer status already landed
            log_line(log, logging.INFO, "status not written", uid=uid, namespace=record.namespace,
                     name=record.name, epoch=record.epoch, http_status=exc.http_status)
            self._settled(uid)
            return
        marked_at = self._settled(uid)
        with self._lock:
            self._written[uid] = (self._clock(), record.phase)
        if marked_at is not None:
            MIRROR_LAG.observe(self._clock() - marked_at)
        # The Events queued before the label: once the status is written they cannot be derived
        # again (the next round finds it current), while the label is checked at every round.
        for reason, message, warning in events_between(previous, status):
            if reason in FINAL_EVENTS or self._limiter.allow(uid, time.monotonic()):
                self.events.put(task, reason, message, warning)
        self._label_dead_letter(task, record)

    def _label_dead_letter(self, task: dict[str, Any], record: TaskRecord) -> None:
        """The dead-letter label as the ledger says (`kubectl get tasks -l retex.dev/dead-letter=true`).
        A failed patch raises: the round keeps the task's mark and the next round checks again."""
        if labelled_dead(task) != record.dead_lettered:
            self._kube.patch_task_labels(record.namespace, record.name, record.uid,
                                         {DEAD_LETTER_LABEL: "true" if record.dead_lettered else None})
