"""The status mirror: Task.status computed from the ledger, and every status and Event write.

One module owns it so the rules hold in one place: status is a pure function of committed
ledger state (plus the lease as observed); it is written only when its ledger version is newer
than the one shown (the CRD's CEL rule refuses an older one anyway); bursts of NOTIFY coalesce
into one write per task; a periodic resync, on a loop of its own, repairs anything missed,
including after restarts; the Events a status change makes are posted on a loop of their own,
which no status write waits for.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from retex.api import REFUSED, ConditionType, LeaseStatus, ShownPhase, StepStatus, TaskStatus, find_condition, set_condition
from retex.failpoints import failpoint
from retex.kube.errors import api_message, transient
from retex.kube.leasewatch import LeaseObservation, LeaseObserver
from retex.kube.objects import lease_name
from retex.kube.operator_calls import EVENT_MESSAGE_MAX, EventNotPosted, KubeCalls, NotLeading, StatusNotWritten
from retex.ledger import Ledger, LedgerError, TaskNotFound, TaskRecord
from retex.logs import log_line
from retex.machine import TaskPhase
from retex.operator.loop import STOPPED_LEADING, Loop
from retex.operator.metrics import EVENTS_DROPPED, EVENTS_QUEUED, MIRROR_LAG, MIRROR_PENDING, count_failure
from retex.operator.witness import behind, frozen_status, recovered_conditions, shown_version

log = logging.getLogger(__name__)

# `kubectl get tasks.retex.dev -l retex.dev/dead-letter=true` lists the dead letters.
DEAD_LETTER_LABEL = "retex.dev/dead-letter"
# The NOTIFY listener, after a failure, listens again after this, doubling up to the max.
LISTEN_RETRY_FIRST_SECONDS = 0.5
LISTEN_RETRY_MAX_SECONDS = 30.0
# A task whose status write failed (not as stale: a 403, a 422 of another rule, a 500) is tried
# again after this, doubling up to the max; the other tasks' writes do not wait for it. After an
# Event post that may succeed later (no answer, a 429, a 5xx), its namespace waits the same way.
WRITE_RETRY_FIRST_SECONDS = 1.0
WRITE_RETRY_MAX_SECONDS = 60.0
# A round's writes go out this many at a time: each is several round trips (100-300 ms each to an
# API server under load), and one after another a change waited for the whole round (on kind at
# scale, status lag p99 15.7 s). controller-runtime's MaxConcurrentReconciles, for the same reason.
WRITERS = 4
# Tasks written per round, two writes per writer: marks made meanwhile are ordered with the rest at
# the next round, so a backlog (thousands of first statuses) holds up a task doing something by
# about two writes (with 20 a round, 1-2.4 s on the rig at scale). Tasks held back (`_held_back`)
# take no place in a round.
WRITE_BATCH = 2 * WRITERS
# A task's status is written at most once this often while its phase stays the same: a task of
# many quick steps moves its ledger version at every step, and a dashboard needs no more. A phase
# change is written at once.
SAME_PHASE_WRITE_FLOOR_SECONDS = 1.0
# Events waiting to be posted, at most. Past it an Event that is not a task's end or its wait for
# a human (`_FINAL_EVENTS`) is dropped and counted, as client-go's broadcaster drops past its
# 1,000: Events are for people, the status carries the state, and an API server that posts slower
# than tasks change must not make the operator's memory grow. Those Events are dropped only past
# the hard capacity (a queued Event holds at most a 1,024-character message: ~15 MB at most).
EVENT_QUEUE_CAPACITY = 1000
EVENT_QUEUE_HARD_CAPACITY = 10 * EVENT_QUEUE_CAPACITY
# An Event whose post may succeed later is tried this many times, going to the back of the queue
# after each while its namespace backs off: one namespace refusing Events for a while (its quota
# full, a webhook failing) holds up no other namespace's.
EVENT_POST_TRIES = 5
# A round of the Event poster posts for at most this long: the probes judge the loop by its rounds.
EVENT_ROUND_SECONDS = 2.0
# A stopping operator posts what is still queued for at most this long (Runtime.stop waits 5 s).
EVENT_DRAIN_SECONDS = 3.0

# (phase) -> (Event reason, warning?) posted when a task enters the phase.
_PHASE_EVENTS = {
    ShownPhase.SCHEDULED: ("Scheduled", False),
    ShownPhase.QUEUED: ("Queued", False),
    ShownPhase.RETRYING: ("Retrying", True),
    ShownPhase.SUCCEEDED: ("Succeeded", False),
    ShownPhase.FAILED: ("Failed", True),
    ShownPhase.CANCELLED: ("Cancelled", False),
    ShownPhase.NEEDS_ATTENTION: ("NeedsAttention", True),
    ShownPhase.LEDGER_BEHIND: ("LedgerBehind", True),
}
# Posted whatever the Event limiter says: the Event of a task's end, or of its wait for a human,
# must not be crowded out by the AttemptStarted catch-up before it. A task enters these phases a
# bounded number of times (once more only after a human action), so they cannot flood anything.
_FINAL_EVENTS = frozenset(_PHASE_EVENTS[phase][0] for phase in (
    ShownPhase.SUCCEEDED, ShownPhase.FAILED, ShownPhase.CANCELLED, ShownPhase.NEEDS_ATTENTION, ShownPhase.LEDGER_BEHIND))


def _summary(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def compute_status(record: TaskRecord, *, lease: LeaseObservation | None, generation: int | None,
                   previous: TaskStatus | None, now: datetime) -> TaskStatus:
    """Task.status for `record`. Pure: the same inputs give the same status."""
    phase = record.phase
    conditions = previous.conditions if previous else None

    def put(kind: ConditionType, true: bool, reason: str, message: str = "") -> None:
        nonlocal conditions
        conditions = set_condition(conditions, kind, "True" if true else "False", reason, message,
                                   observed_generation=generation, now=now)

    why = record.reason or str(phase)
    error = record.last_error or ""
    put(ConditionType.ACCEPTED, True, "Admitted", "recorded in the ledger")
    put(ConditionType.RUNNING, phase == TaskPhase.RUNNING,
        "AttemptRunning" if phase == TaskPhase.RUNNING else str(phase),
        f"attempt {record.epoch}" if phase == TaskPhase.RUNNING else "")
    put(ConditionType.SUCCEEDED, phase == TaskPhase.SUCCEEDED, why if phase == TaskPhase.SUCCEEDED else "NotSucceeded")
    put(ConditionType.FAILED, phase == TaskPhase.FAILED, why if phase == TaskPhase.FAILED else "NotFailed",
        error if phase == TaskPhase.FAILED else "")
    put(ConditionType.DEAD_LETTERED, record.dead_lettered, why if record.dead_lettered else "NotDeadLettered",
        error if record.dead_lettered else "")
    put(ConditionType.NEEDS_ATTENTION, phase == TaskPhase.NEEDS_ATTENTION,
        why if phase == TaskPhase.NEEDS_ATTENTION else "NoAmbiguousStep",
        error if phase == TaskPhase.NEEDS_ATTENTION else "")
    # One condition for every ending, so `kubectl wait --for=condition=Completed` returns whatever
    # the outcome. NeedsAttention is not an ending: a human's resolve lets the task run on.
    put(ConditionType.COMPLETED, record.terminal, str(phase),
        (f"{why}: {error}" if error else why) if record.terminal else "")

    lease_status = None
    if lease is not None and lease.holder_pod is not None and phase == TaskPhase.RUNNING:
        lease_status = LeaseStatus(holder=f"{lease.holder_pod}:{lease.holder_epoch}",
                                   renewed_at=datetime.fromtimestamp(lease.changed_wall, UTC),
                                   duration_seconds=lease.duration_seconds)
    return TaskStatus(
        phase=ShownPhase(phase),
        attempt=record.epoch,
        completed_steps=record.completed_steps,
        total_steps=len(record.steps),
        steps=[
            StepStatus(name=s.name, state=s.state, attempt=s.attempt, started_at=s.started_at,
                       finished_at=s.finished_at, result=_summary(s.result), error=s.error)
            for s in record.steps
        ],
        lease=lease_status,
        retries=record.failures,
        disruptions=record.disruptions,
        conditions=conditions,
        ledger_version=record.version,
        observed_generation=generation,
        start_time=record.started_at,
        completion_time=record.finished_at if record.terminal else None,
        last_error=record.last_error,
    )


def as_merge_patch(status: TaskStatus) -> dict[str, Any]:
    """The whole status as a merge patch: a field that is now unset is sent as null, which
    deletes it (a merge patch keeps what it does not mention: a finished task would go on showing
    its last lease holder)."""
    patch = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    unset = {name for name, value in status.model_dump(by_alias=True).items() if value is None}
    return {**patch, **dict.fromkeys(unset)}


class EventLimiter:
    """At most `burst` Events per task per `window` seconds: a crash-looping task cannot flood
    the API server. It keeps only the tasks that posted within the last window or two: an
    operator's life sees millions of tasks."""

    def __init__(self, burst: int = 10, window: float = 60.0):
        self._burst, self._window = burst, window
        self._sent: dict[str, list[float]] = {}
        self._next_sweep: float | None = None
        self._lock = threading.Lock()  # the mirror's writers and kopf's handlers (`warn`) ask at once

    @property
    def tasks_kept(self) -> int:
        return len(self._sent)

    def allow(self, uid: str, now: float) -> bool:
        with self._lock:
            if self._next_sweep is None or now >= self._next_sweep:
                self._sent = {kept: times for kept, times in self._sent.items() if now - times[-1] < self._window}
                self._next_sweep = now + self._window
            recent = [t for t in self._sent.get(uid, []) if now - t < self._window]
            if len(recent) >= self._burst:
                self._sent[uid] = recent
                return False
            self._sent[uid] = [*recent, now]
            return True


def _events_between(previous: TaskStatus | None, current: TaskStatus) -> list[tuple[str, str, bool]]:
    """(reason, message, warning) for what changed between the shown and the new status."""
    events = []
    if previous is None or previous.phase is None:
        events.append(("Accepted", "recorded in the ledger", False))
    # Every attempt started since the shown status, also one that ended before the mirror saw it
    # Running (a short task can go from Queued to Succeeded between two writes).
    old_attempt = (previous.attempt or 0) if previous else 0
    for attempt in range(old_attempt + 1, (current.attempt or 0) + 1):
        events.append(("AttemptStarted", f"attempt {attempt} dispatched", False))
    if previous is None or previous.phase != current.phase:
        if current.phase in _PHASE_EVENTS:
            reason, warning = _PHASE_EVENTS[current.phase]
            frozen = find_condition(current.conditions, ConditionType.LEDGER_BEHIND)
            why = frozen.message if current.phase == ShownPhase.LEDGER_BEHIND and frozen else current.last_error
            events.append((reason, why or f"task {current.phase}", warning))
    return events


def _labelled_dead(task: dict[str, Any]) -> bool:
    return (task["metadata"].get("labels") or {}).get(DEAD_LETTER_LABEL) == "true"


def _involved(task: dict[str, Any]) -> dict[str, Any]:
    """What an Event names of its Task (`KubeCalls.post_event` reads no more): a queued Event holds
    no spec, which may be 64 KiB."""
    meta = task["metadata"]
    return {"apiVersion": task["apiVersion"], "kind": task["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}}


def _may_post_later(exc: BaseException) -> bool:
    """No answer, a 429, a 5xx: the same post may succeed later. A refusal for good may not."""
    return transient(exc.__cause__ if isinstance(exc, EventNotPosted) and exc.__cause__ else exc)


@dataclass(slots=True)
class _QueuedEvent:
    task: dict[str, Any]  # `_involved`: the Task's name and uid, not its spec
    reason: str
    message: str
    warning: bool
    tries: int = 0


class EventPoster(Loop):
    """Posts the status mirror's Events, oldest first, on a loop of its own. A post is a round trip
    (on the rig at scale 60 ms on average, 230 ms at p95: 40% of a status write), and in the
    writers' path every status change behind it waited for it."""

    name = "event-poster"
    period = 1.0

    def __init__(self, kube: KubeCalls, *, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._kube, self._clock = kube, clock
        self._queue: deque[_QueuedEvent] = deque()
        self._lock = threading.Lock()  # the queue: the mirror's writers put, the poster takes
        self._posting = threading.Lock()  # one post at a time: the poster's, or the mirror's drain at stop
        self._dropped = 0  # since the queue was last empty: logged once when it fills, again when it drains
        # namespace -> (no post before, next delay), after a post there that may succeed later
        self._backoff: dict[str, tuple[float, float]] = {}
        self._leadership = 0  # `forget` counts: an Event taken out before it is not put back after it
        EVENTS_QUEUED.set_function(lambda: len(self._queue))

    def put(self, task: dict[str, Any], reason: str, message: str, warning: bool) -> None:
        with self._lock:
            if len(self._queue) >= (EVENT_QUEUE_HARD_CAPACITY if reason in _FINAL_EVENTS else EVENT_QUEUE_CAPACITY):
                EVENTS_DROPPED.inc()
                if not self._dropped:
                    log_line(log, logging.WARNING, "event queue full: Events other than a task's end are dropped "
                             "until it drains", capacity=EVENT_QUEUE_CAPACITY)
                self._dropped += 1
                return
            self._queue.append(_QueuedEvent(_involved(task), reason, message[:EVENT_MESSAGE_MAX], warning))
        self.wake.set()

    def forget(self) -> None:
        """Drop (and count) what an earlier leadership of this replica queued: its Events may be hours
        old, and posted now they would show out of order beside the other leader's."""
        with self._lock:
            EVENTS_DROPPED.inc(len(self._queue))
            self._queue.clear()
            self._dropped, self._backoff = 0, {}
            self._leadership += 1

    def round(self) -> float:
        """Post for at most `EVENT_ROUND_SECONDS`. Never waits longer than `period` between rounds:
        the probes judge this loop by its rounds, and a backoff of a minute would make the leader
        unready."""
        ends = self._clock() + EVENT_ROUND_SECONDS
        return self._post_queued(lambda: not self.stopping and self._clock() < ends)

    def drain(self) -> None:
        """Post what is queued, for at most `EVENT_DRAIN_SECONDS`: the operator stops, and the next
        leader, finding the statuses current, cannot derive these Events again. The status mirror
        calls it once its last writes have queued their Events. What is left is counted as dropped."""
        if self.may_write():
            deadline = self._clock() + EVENT_DRAIN_SECONDS
            try:
                self._post_queued(lambda: self._clock() < deadline)
            except Exception as exc:
                log_line(log, logging.WARNING, "events queued at stop not posted", error=f"{type(exc).__name__}: {exc}")
        with self._lock:
            if self._queue:
                log_line(log, logging.WARNING, "events queued at stop dropped", count=len(self._queue))
                EVENTS_DROPPED.inc(len(self._queue))
                self._queue.clear()

    def _post_queued(self, going_on: Callable[[], bool]) -> float:
        """Post the queued Events, oldest first, while `going_on()`; returns when to go on (at most
        `period`). One the API server refuses for good is logged and let go. One that may post later
        (`_may_post_later`) goes to the back of the queue, up to `EVENT_POST_TRIES` times, and its
        namespace backs off: its Events go to the back untried meanwhile (their order kept), and
        the other namespaces' are posted. One refused because this replica stopped leading goes
        back to the head (`forget` drops it when this replica leads again) and the round ends."""
        skipped = 0  # Events in a row whose namespace backs off: all of them, and the round waits
        while going_on():
            with self._posting:
                with self._lock:
                    if not self._queue:
                        if self._dropped:
                            log_line(log, logging.WARNING, "event queue drained", dropped=self._dropped)
                        self._dropped = 0
                        return self.period
                    if skipped >= len(self._queue):
                        return self._until_a_backoff_ends()
                    queued, leadership = self._queue.popleft(), self._leadership
                namespace = queued.task["metadata"]["namespace"]
                if self._clock() < self._backoff.get(namespace, (0.0, 0.0))[0]:
                    self._put_back(queued, leadership)
                    skipped += 1
                    continue
                skipped = 0
                try:
                    self._kube.post_event(queued.task, reason=queued.reason, message=queued.message,
                                          warning=queued.warning)
                except Exception as exc:
                    if isinstance(exc, STOPPED_LEADING):
                        self._put_back(queued, leadership, at_head=True)
                        raise
                    if _may_post_later(exc):
                        self._post_later(queued, leadership, exc)
                        continue
                    if not isinstance(exc, EventNotPosted):
                        raise  # a bug: counted and logged by the loop, the Event let go
                    log_line(log, logging.WARNING, "event not posted", uid=queued.task["metadata"]["uid"],
                             reason=queued.reason, http_status=exc.http_status)
                    continue
                self._backoff.pop(namespace, None)
        return 0.0

    def _put_back(self, queued: _QueuedEvent, leadership: int, *, at_head: bool = False) -> None:
        with self._lock:
            if leadership != self._leadership:  # forgotten while it was out of the queue
                EVENTS_DROPPED.inc()
            elif at_head:
                self._queue.appendleft(queued)
            else:
                self._queue.append(queued)

    def _until_a_backoff_ends(self) -> float:
        """Every queued Event's namespace backs off: until the first of those backoffs ends. One
        already over is some other namespace's (its Events posted or dropped), and no reason to go
        round again at once."""
        now = self._clock()
        soonest = min((not_before for not_before, _ in self._backoff.values() if not_before > now), default=now)
        return min(soonest - now, self.period)

    def _post_later(self, queued: _QueuedEvent, leadership: int, exc: Exception) -> None:
        """To the back of the queue (dropped after `EVENT_POST_TRIES`), its namespace backing off."""
        count_failure(self.name, exc)
        namespace = queued.task["metadata"]["namespace"]
        _, delay = self._backoff.get(namespace, (0.0, WRITE_RETRY_FIRST_SECONDS))
        self._backoff[namespace] = (self._clock() + delay, min(delay * 2, WRITE_RETRY_MAX_SECONDS))
        queued.tries += 1
        if queued.tries < EVENT_POST_TRIES:
            self._put_back(queued, leadership)
        else:
            EVENTS_DROPPED.inc()
        log_line(log, logging.WARNING, "event not posted; trying again" if queued.tries < EVENT_POST_TRIES
                 else "event not posted; dropped", uid=queued.task["metadata"]["uid"], namespace=namespace,
                 reason=queued.reason, tries=queued.tries, error=f"{type(exc).__name__}: {exc}",
                 namespace_retry_seconds=delay)


class StatusResync(Loop):
    """Every `period` seconds, mark every Task whose status lags the ledger (`StatusMirror.mark_behind`).
    A loop of its own: its LIST of every Task takes seconds at scale (1-2.5 s for 5,000 on the
    rig), and no status write waits for it."""

    name = "status-resync"

    def __init__(self, mark_behind: Callable[[], None], *, period: float):
        super().__init__()
        self._mark_behind, self.period = mark_behind, period

    def round(self) -> float:
        self._mark_behind()
        return self.period


def in_fair_order(uids: list[str], phases: dict[str, tuple[str, TaskPhase]],
                  marked_at: dict[str, float]) -> list[str]:
    """The order a backlog of marked tasks is written in. Tasks doing something first, a task
    waiting for its notBefore (Scheduled) last: its status says only that it waits. Within each,
    the namespaces take turns, one task each, the oldest mark first: a namespace with thousands of
    marks holds up another's status by a write a round, not by its whole backlog. `phases`: uid →
    (namespace, phase) as the ledger holds it; the tasks it does not hold take turns as one namespace."""

    def waits(uid: str) -> bool:
        return uid in phases and phases[uid][1] == TaskPhase.SCHEDULED

    by_mark = sorted(uids, key=lambda uid: (waits(uid), marked_at.get(uid, 0.0)))
    turn: dict[str, int] = {}
    taken: Counter[tuple[bool, str | None]] = Counter()
    for uid in by_mark:  # each task's turn: how many of its namespace's come before it
        namespace = (waits(uid), phases[uid][0] if uid in phases else None)
        turn[uid] = taken[namespace]
        taken[namespace] += 1
    return sorted(by_mark, key=lambda uid: (waits(uid), turn[uid]))  # stable: by mark within a turn


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
            elif (shown_version(task) or -1) < ledger_versions[uid] or _labelled_dead(task) != (uid in dead):
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
        for reason, message, warning in _events_between(previous, status):
            if reason in _FINAL_EVENTS or self._limiter.allow(uid, time.monotonic()):
                self.events.put(task, reason, message, warning)
        self._label_dead_letter(task, record)

    def _label_dead_letter(self, task: dict[str, Any], record: TaskRecord) -> None:
        """The dead-letter label as the ledger says (`kubectl get tasks -l retex.dev/dead-letter=true`).
        A failed patch raises: the round keeps the task's mark and the next round checks again."""
        if _labelled_dead(task) != record.dead_lettered:
            self._kube.patch_task_labels(record.namespace, record.name, record.uid,
                                         {DEAD_LETTER_LABEL: "true" if record.dead_lettered else None})
