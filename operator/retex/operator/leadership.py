"""Which replica of the operator writes: the leader election's thread and its answer.

Every retry period the thread reads the election Lease and writes it when `Election.decide` says
so (retex.kube.election). Every writer asks `leading()` itself, on its own clock, right before a
round or a handler: a replica that was paused (SIGSTOP, a long GC, a partition) past its renew
deadline stops writing when it resumes, before this thread has run again. Becoming leader calls
`on_started` (fresh grace for every worker lease, a full status resync, the ledger's leadership
term taken before any writer starts: retex.operator.handlers.Runtime) under the lock `leading()`
takes, so no writer hears that it leads before that is done (`on_started` must not ask
`leading()` itself); losing it only logs and flips `retex_leader`: the writers stopped already by
asking.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from retex.kube.election import Decision, Election, ElectionTiming, LeaderLease
from retex.kube.leases import LeaseConflict
from retex.logs import event
from retex.operator.metrics import LEADER

log = logging.getLogger(__name__)


class Leadership:
    def __init__(self, lease: LeaderLease, identity: str, timing: ElectionTiming, *,
                 on_started: Callable[[], None], clock: Callable[[], float] = time.monotonic):
        self._lease, self.timing, self._clock = lease, timing, clock
        self._election = Election(identity, timing)
        self._on_started = on_started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._was_leading = False
        self.identity = identity

    def leading(self) -> bool:
        with self._lock:
            return self._election.leading(self._clock())

    def run(self) -> None:
        while not self._stop.is_set():
            self.try_acquire_or_renew()
            self._stop.wait(self.timing.retry_period)

    def try_acquire_or_renew(self) -> None:
        started = self._clock()
        try:
            record = self._lease.read()
            with self._lock:
                self._election.observe(record, started)
                decision = self._election.decide(started)
                # A new leadership unless this replica was leading at `started`, by its own clock:
                # not `_was_leading`, which a replica paused past the lease duration still holds
                # when its first round after resuming takes the Lease again.
                continuing = self._election.leading(started)
            if decision is not Decision.WAIT:
                written = self._election.record(decision, datetime.now(UTC))
                self._lease.write(written)
                with self._lock:
                    if not continuing:
                        # Under the lock, before `won`: a writer asking leading() waits until the
                        # term has started (the fresh grace granted), so no round runs before it;
                        # if it fails, this replica does not lead, and tries again next retry.
                        self._on_started()
                    self._election.won(written, started)
        except LeaseConflict:
            pass  # another replica wrote first: read again at the next retry
        except Exception as exc:  # the API server unreachable or slow: the renew deadline decides
            event(log, logging.WARNING, "leader election: call failed", error=f"{type(exc).__name__}: {exc}")
        self._notice()

    def _notice(self) -> None:
        leading = self.leading()
        if leading and not self._was_leading:
            event(log, logging.INFO, "leader election: this replica leads", identity=self._election.identity)
            LEADER.set(1)
            self._was_leading = True
        elif not leading and self._was_leading:
            holder = self._election.observed.holder if self._election.observed else None
            event(log, logging.WARNING, "leader election: this replica stopped leading", identity=self._election.identity,
                  holder=holder)
            LEADER.set(0)
            self._was_leading = False

    def stop(self) -> None:
        """Stop electing; a leader gives the Lease up so a standby takes over at its next retry."""
        self._stop.set()
        with self._lock:
            if not self._election.leading(self._clock()):
                return
            released = self._election.released_record(datetime.now(UTC))
        try:
            self._lease.write(released)
            with self._lock:
                self._election.released(released, self._clock())
            LEADER.set(0)
            event(log, logging.INFO, "leader election: released the lease", identity=self._election.identity)
        except Exception as exc:  # it expires after its duration instead
            event(log, logging.WARNING, "leader election: releasing the lease failed", error=str(exc))
