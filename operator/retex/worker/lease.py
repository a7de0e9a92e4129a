"""The worker's hold on its attempt's Lease: acquire, renew in the background, release.

The Lease is liveness for the operator, not safety: every ledger write is fenced by epoch, so a
worker that loses its Lease without noticing cannot corrupt the ledger. External effects are not
fenced by the ledger, though: once the worker can no longer show it holds the Lease (`still_held`
turns false at the renew deadline, `LeaseTiming`), it kills its running step and starts no other,
before the operator can judge the Lease expired and start the next attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from retex.kube.errors import transient
from retex.kube.leases import (
    Holder,
    LeaseConflict,
    LeaseNotFound,
    LeaseTiming,
    LeaseView,
    RenewalWatch,
    Verdict,
    acquired,
    judge,
    read_lease,
    released,
    renewed,
    replace_lease,
)
from retex.kube.rest import RestClient
from retex.logs import log_line

log = logging.getLogger(__name__)


class LeaseRefused(Exception):
    """Held by a live pod of our epoch, by a newer epoch, or by something that is not retex."""


class LeaseUnavailable(Exception):
    """The Lease is missing, or the API server stayed unreachable for a lease duration."""


class AttemptLease:
    def __init__(self, api: RestClient, namespace: str, name: str, me: Holder, timing: LeaseTiming, *,
                 clock: Callable[[], float] = time.monotonic):
        self._api, self._namespace, self._name, self.me = api, namespace, name, me
        self.timing = timing
        self.duration = timing.duration
        self._clock = clock
        self._timeout = timing.request_timeout
        self._body: dict[str, Any] | None = None
        # When the last successful write was *sent*: the server wrote it after that, and the
        # operator observed it later still, so counting from here is on the safe side.
        self._last_renewal = float("-inf")
        self._taken_from_us = False
        # Once still_held() has said False it never says True again: the worker acts on it at
        # once (kills the step, stops), and a renewal sent before the deadline that succeeds after
        # it must not revive the lease under a part of the worker that has not looked yet.
        self._given_up = False
        self._judging = threading.Lock()  # the caller's judgement vs the renewer's update
        self._stopping = threading.Event()
        self._renewer: threading.Thread | None = None

    # -- acquiring ---------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the Lease, or raise LeaseRefused / LeaseUnavailable. Waits (at most about one lease
        duration) only while a same-epoch holder is neither seen renewing nor silent long enough."""
        watch = RenewalWatch()
        unreachable_since: float | None = None
        poll = min(1.0, self.duration / 6)
        while True:
            try:
                body = self._read()
                view = LeaseView.of(body)
                watch.observe(view, self._clock())
                verdict = judge(view, self.me, watch, self._clock(), default_duration=self.duration)
                if verdict is Verdict.TAKE:
                    sent = self._clock()
                    self._body = self._replace(acquired(body, self.me, int(self.duration), datetime.now(UTC)))
                    self._last_renewal = sent
                    log_line(log, logging.INFO, "lease acquired", lease=self._name, holder=self.me.identity,
                             previous_holder=view.holder_identity)
                    return
                unreachable_since = None
            except LeaseConflict:
                continue  # someone wrote it between our read and our write: re-read, re-decide
            except LeaseNotFound as exc:
                raise LeaseUnavailable(str(exc)) from exc
            except Exception as exc:
                if not transient(exc):
                    raise  # 403 and the like: a misconfiguration, a crash
                unreachable_since = unreachable_since or self._clock()
                if self._clock() - unreachable_since > self.duration:
                    raise LeaseUnavailable(f"API server unreachable for {self.duration}s: {exc}") from exc
                log_line(log, logging.WARNING, "lease read/write failed, retrying", error=str(exc))
                time.sleep(poll)
                continue
            if verdict is Verdict.REFUSE:
                raise LeaseRefused(f"lease {self._name} is held by {view.holder_identity}")
            time.sleep(poll)  # WAIT: watch the same-epoch holder a little longer

    # -- renewing ----------------------------------------------------------------------------

    def start_renewing(self) -> None:
        self._renewer = threading.Thread(target=self._renew_loop, name="retex-lease-renewer", daemon=True)
        self._renewer.start()

    def still_held(self) -> bool:
        """False once someone else took it, or at the renew deadline without a successful renewal.
        Computed from the clock on the caller's thread, so a renewer stuck in a call cannot delay it."""
        if self._taken_from_us:
            return False
        with self._judging:
            if self._given_up:
                return False
            if self._clock() - self._last_renewal < self.timing.renew_deadline:
                return True
            self._given_up = True
        log_line(log, logging.WARNING, "lease lost: renew deadline passed",
                 renew_deadline_seconds=round(self.timing.renew_deadline, 2),
                 seconds_since_renewal=round(self._clock() - self._last_renewal, 2))
        return False

    def _renewed(self, sent: float) -> None:
        with self._judging:
            if not self._given_up:
                self._last_renewal = sent

    def _renew_loop(self) -> None:
        # A try every retry period, counted from the start of the previous one: a failing call
        # (bounded by the period) is retried at once, so about five tries fit in the renew deadline.
        next_try = self._clock() + self.timing.retry_period
        while not self._stopping.wait(max(0.0, next_try - self._clock())):
            if not self.still_held():
                return  # given up: the worker kills its step and exits; release() still tries
            next_try = self._clock() + self.timing.retry_period
            try:
                self._renew_once()
            except Exception as exc:  # noqa: BLE001 - the renewer must outlive any one failure
                # Even a non-transient error (RBAC revoked) only stops renewals landing: still_held()
                # turns false at the renew deadline and the worker kills its step and stops.
                log_line(log, logging.WARNING if transient(exc) else logging.ERROR, "lease renewal failed",
                         error=str(exc), seconds_since_renewal=round(self._clock() - self._last_renewal, 1))

    def _renew_once(self) -> None:
        for _ in range(2):  # a conflict while we still hold it (someone touched metadata): once more
            assert self._body is not None  # renewing starts once acquire() has taken it
            try:
                sent = self._clock()
                self._body = self._replace(renewed(self._body, datetime.now(UTC)))
                self._renewed(sent)
                return
            except LeaseConflict:
                if not self._refresh_if_ours():
                    return
            except LeaseNotFound:
                self._lost("the lease was deleted")
                return

    def _refresh_if_ours(self) -> bool:
        current = self._read()
        if LeaseView.of(current).holder_identity != self.me.identity:
            self._lost(f"taken by {LeaseView.of(current).holder_identity}")
            return False
        self._body = current
        return True

    def _lost(self, why: str) -> None:
        self._taken_from_us = True
        log_line(log, logging.WARNING, "lease lost", why=why)

    # -- releasing ---------------------------------------------------------------------------

    def release(self) -> None:
        """Stop renewing and clear the holder, only if it is still ours. Best effort: if it fails,
        the Lease simply expires."""
        self._stopping.set()
        if self._renewer is not None:
            self._renewer.join()
        if self._body is None or self._taken_from_us:
            return
        try:
            for _ in range(2):
                try:
                    self._replace(released(self._body, datetime.now(UTC)))
                    log_line(log, logging.INFO, "lease released", lease=self._name)
                    return
                except LeaseConflict:
                    if not self._refresh_if_ours():
                        return
        except Exception as exc:  # noqa: BLE001 - the Lease expires on its own
            log_line(log, logging.WARNING, "lease release failed; it will expire", error=str(exc))

    # -- calls -------------------------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        return read_lease(self._api, self._namespace, self._name, timeout=self._timeout)

    def _replace(self, body: dict[str, Any]) -> dict[str, Any]:
        return replace_lease(self._api, self._namespace, self._name, body, timeout=self._timeout)
