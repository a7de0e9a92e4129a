"""The status mirror's Events, posted on a loop of their own (`EventPoster`), which no status
write waits for, and at most a burst per task (`EventLimiter`): Events are for people, the status
carries the state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retex.kube.errors import transient
from retex.kube.operator_calls import EVENT_MESSAGE_MAX, EventNotPosted, KubeCalls
from retex.logs import log_line
from retex.operator.loop import STOPPED_LEADING, Loop
from retex.operator.metrics import EVENTS_DROPPED, EVENTS_QUEUED, count_failure
from retex.operator.status import FINAL_EVENTS

log = logging.getLogger(__name__)

# Events waiting to be posted, at most. Past it an Event that is not a task's end or its wait for
# a human (retex.operator.status.FINAL_EVENTS) is dropped and counted, as client-go's broadcaster
# drops past its 1,000: Events are for people, the status carries the state, and an API server that posts slower
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
# An Event post that may succeed later (no answer, a 429, a 5xx) makes its namespace wait this long
# before the next, doubling up to the max; the other namespaces' posts do not wait.
POST_RETRY_FIRST_SECONDS = 1.0
POST_RETRY_MAX_SECONDS = 60.0


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
            if len(self._queue) >= (EVENT_QUEUE_HARD_CAPACITY if reason in FINAL_EVENTS else EVENT_QUEUE_CAPACITY):
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
        _, delay = self._backoff.get(namespace, (0.0, POST_RETRY_FIRST_SECONDS))
        self._backoff[namespace] = (self._clock() + delay, min(delay * 2, POST_RETRY_MAX_SECONDS))
        queued.tries += 1
        if queued.tries < EVENT_POST_TRIES:
            self._put_back(queued, leadership)
        else:
            EVENTS_DROPPED.inc()
        log_line(log, logging.WARNING, "event not posted; trying again" if queued.tries < EVENT_POST_TRIES
                 else "event not posted; dropped", uid=queued.task["metadata"]["uid"], namespace=namespace,
                 reason=queued.reason, tries=queued.tries, error=f"{type(exc).__name__}: {exc}",
                 namespace_retry_seconds=delay)

