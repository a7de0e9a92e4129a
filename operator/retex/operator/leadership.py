"""Which replica of the operator writes: the leader election's thread and its answer.

Every retry period the thread reads the election Lease and writes it when `Election.decide` says so
(retex.kube.election); a leader just writes its renewal, and reads only when that conflicts. Every
writer asks `leading()` itself, on its own clock, right before a round or a handler: a replica that
was paused (SIGSTOP, a long GC, a partition) past its renew deadline stops writing when it resumes,
before this thread has run again. Becoming leader calls `on_started` (fresh grace for every worker
lease, a full status resync, the ledger's leadership term taken before any writer starts:
retex.operator.handlers.Runtime) under the lock `leading()` takes, so no writer hears that it leads
before that is done (`on_started` asking `leading()` itself hears False: the lock is reentrant).
When `on_started` raises or returns past the renew deadline, this replica does not lead and gives
the Lease up (`Leadership`); so does a leader that `may_keep` says no to (it could not take the
ledger's term), and it then rests a lease duration. `restart` stops leading until the next Lease
write succeeds, which starts a new leadership. Losing it only logs and flips `retex_leader`: the
writers stopped already by asking.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from retex.kube.election import Decision, Election, ElectionTiming, LeaderLease, LeaderRecord
from retex.kube.leases import LeaseConflict
from retex.logs import log_line
from retex.operator.metrics import LEADER

log = logging.getLogger(__name__)


class Leadership:
    """The election's thread and its answer, `leading()`. A takeover whose `on_started` raises, or
    returns after the renew deadline of the Lease write it follows, does not lead: this replica
    writes the released record (as `stop` does), so a standby takes over at its next retry rather
    than wait on a Lease renewed by a replica that never leads, and tries again itself next retry.
    The lock is reentrant: `on_started` asking `leading()` hears False (not yet), not a deadlock."""

    def __init__(self, lease: LeaderLease, identity: str, timing: ElectionTiming, *,
                 on_started: Callable[[], None], may_keep: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic):
        self._lease, self.timing, self._clock = lease, timing, clock
        self._election = Election(identity, timing)
        self._on_started = on_started
        self._may_keep = may_keep  # asked before each renewal: False gives the Lease up (`_step_down`)
        self._resting_until = float("-inf")  # our clock: no Lease taken before (after `_step_down`)
        # Reentrant: `on_started` runs under it, and may ask leading() (it hears False: not yet).
        self._lock = threading.RLock()
        # Held for a whole round: `stop` waits for the round under way before it releases the
        # Lease, so a renewal in flight neither lands after the release nor reads it as free.
        self._round = threading.Lock()
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
        with self._round:
            if not self._stop.is_set():
                self._one_round()

    def _one_round(self) -> None:
        started = self._clock()
        if started < self._resting_until:
            self._notice()
            return
        if self.leading() and not self._may_keep():
            self._step_down(started)
            self._notice()
            return
        try:
            if self._leading_on_its_own_lease() and self._renew_unread(started):
                self._notice()
                return
            record = self._lease.read(timeout=self._call_timeout())
            with self._lock:
                # Dated when the answer came (client-go's observedTime): a renewal that landed
                # while the read was under way was seen now, not when we asked.
                seen_at = self._clock()
                self._election.observe(record, seen_at)
                if self._election.observed_holder_is_another() and self._election.leading(seen_at):
                    # Someone else wrote the Lease (it was deleted and re-created, or edited): two
                    # replicas must not both lead, even until this one's renew deadline.
                    self._election.stop_leading()
                decision = self._election.decide(seen_at)
                # A new leadership unless this round renews a Lease this replica was leading on at
                # `started`, by its own clock: not `_was_leading`, which a replica paused past the
                # lease duration still holds when its first round after resuming takes the Lease
                # again; and never a TAKE or CREATE (a read that stalled while a successor took the
                # Lease and released it).
                continuing = decision is Decision.RENEW and self._election.leading(started)
            if decision is not Decision.WAIT:
                self._write(decision, started, continuing=continuing)
        except LeaseConflict:
            pass  # another replica wrote first: read again at the next retry
        except Exception as exc:  # the API server unreachable or slow: the renew deadline decides
            log_line(log, logging.WARNING, "leader election: call failed", error=f"{type(exc).__name__}: {exc}")
        self._notice()

    def _leading_on_its_own_lease(self) -> bool:
        with self._lock:
            return self._election.leading(self._clock()) and not self._election.observed_holder_is_another()

    def _renew_unread(self, started: float) -> bool:
        """A leader's renewal without reading first (client-go's fast path): the write is
        conditional on the Lease being as this replica last wrote it, so it needs no read unless
        someone else wrote since. One call a retry period instead of two, where a loaded API
        server makes every call count. False when it failed (a conflict, a timeout, a 404): read,
        and decide on what is there."""
        try:
            self._write(Decision.RENEW, started, continuing=True)
        except Exception as exc:
            if not isinstance(exc, LeaseConflict):
                log_line(log, logging.WARNING, "leader election: renewal failed; reading the lease",
                         error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    def _write(self, decision: Decision, started: float, *, continuing: bool) -> None:
        """Write the Lease as `decision` says; a new leadership (not `continuing`) starts under
        the lock once the write succeeded, or gives the Lease up if starting failed. Nothing is
        written once `stop` was asked."""
        if self._stop.is_set():
            return
        written = self._election.record(decision, datetime.now(UTC))
        self._lease.write(written, timeout=self._call_timeout())
        with self._lock:
            # Asked again: a `restart` while the write was under way makes it a new leadership.
            continuing = continuing and self._election.leading(started)
            # Under the lock, before `won`: a writer asking leading() waits until the
            # term has started (the fresh grace granted), so no round runs before it.
            failed = None if continuing else self._start(started)
            if failed is None:
                self._election.won(written, started)
            else:  # not leading: give the Lease up (below) rather than lock a standby out
                self._election.observe(written, self._clock())
                released = self._election.released_record(datetime.now(UTC))
        if failed is not None:
            log_line(log, logging.ERROR, "leader election: on_started failed; releasing the lease",
                     identity=self._election.identity, error=failed)
            # If this fails, the next retry renews and starts again.
            self._lease.write(released, timeout=self._call_timeout())
            with self._lock:
                self._election.released(released, self._clock())

    def _call_timeout(self) -> float:
        with self._lock:
            return self._election.call_timeout(self._clock())

    def restart(self) -> None:
        """Stop leading now, and lead again only as a new leadership (`on_started` again) once
        the next round's Lease write succeeded: that write's resourceVersion check, not this
        replica's clock, proves it still holds the Lease. For a leader whose ledger term moved
        on while its clock said it led (retex.operator.handlers.Runtime._term_lost)."""
        with self._lock:
            self._election.stop_leading()

    def _step_down(self, now: float) -> None:
        """A leader that may not keep the Lease (it went a lease duration without the ledger's
        term: retex.operator.handlers.Runtime): stop leading now, write the released record so a
        standby takes over at its next retry, and take no Lease for a lease duration (else this
        replica's next round would take the free Lease straight back)."""
        log_line(log, logging.ERROR, "leader election: this leader cannot take the ledger's term; giving the lease up",
                 identity=self._election.identity, rest_seconds=self.timing.lease_duration)
        with self._lock:
            self._election.stop_leading()
            released = self._election.released_record(datetime.now(UTC))
        self._resting_until = now + self.timing.lease_duration
        self._release(released)

    def _release(self, released: LeaderRecord) -> bool:
        """Write the released record so a standby takes over at its next retry: False if the
        write failed (the Lease then expires after its duration instead)."""
        try:
            self._lease.write(released, timeout=self._call_timeout())
        except Exception as exc:
            log_line(log, logging.WARNING, "leader election: releasing the lease failed", error=f"{type(exc).__name__}: {exc}")
            return False
        with self._lock:
            self._election.released(released, self._clock())
        return True

    def _start(self, started: float) -> str | None:
        """`on_started`, for the Lease write that began at `started`: None if it returned in time
        to lead on that write, else why this replica does not lead (it tries again next retry, or
        a standby takes over)."""
        try:
            self._on_started()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        if self._clock() >= started + self.timing.renew_deadline:
            return f"it returned after the renew deadline ({self.timing.renew_deadline:g}s)"
        return None

    def _notice(self) -> None:
        leading = self.leading()
        if leading and not self._was_leading:
            log_line(log, logging.INFO, "leader election: this replica leads", identity=self._election.identity)
            LEADER.set(1)
            self._was_leading = True
        elif not leading and self._was_leading:
            holder = self._election.observed.holder if self._election.observed else None
            log_line(log, logging.WARNING, "leader election: this replica stopped leading", identity=self._election.identity,
                     holder=holder)
            LEADER.set(0)
            self._was_leading = False

    def stop(self) -> None:
        """Stop electing; a leader gives the Lease up so a standby takes over at its next retry,
        once the round under way has ended (its calls end by the renew deadline)."""
        self._stop.set()
        ended = self._round.acquire(timeout=self.timing.renew_deadline)
        try:
            with self._lock:
                if not self._election.leading(self._clock()):
                    return
                released = self._election.released_record(datetime.now(UTC))
            if self._release(released):
                LEADER.set(0)
                log_line(log, logging.INFO, "leader election: released the lease", identity=self._election.identity)
        finally:
            if ended:
                self._round.release()
