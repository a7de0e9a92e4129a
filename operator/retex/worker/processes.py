"""Child processes of steps: each in its own process group, so a timeout or the drain deadline
stops everything the step started, not just its first process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from retex.api.models import Step
from retex.worker.calls import StepCall, Supervision
from retex.worker.drain import Drain

_POLL_SECONDS = 0.05
LEASE_LOST = "lease lost (renew deadline passed, or taken): the step was killed"


# After the timeout and the worker's SIGTERM grace: a live worker's graceful stop comes first.
OWN_KILL_AFTER_GRACE_SECONDS = 1.0


def own_deadline(step: Step, call: StepCall, sup: Supervision) -> float:
    """When the step's group leader SIGKILLs its group by itself, whatever the worker does (a
    SIGSTOPped worker enforces nothing): a CLOCK_MONOTONIC moment, begin + timeout + grace + 1 s,
    inside the margin the next attempt waits out (attempt.DEADLINE_MARGIN_SECONDS)."""
    return call.begun + step.timeout_seconds + sup.kill_grace_seconds + OWN_KILL_AFTER_GRACE_SECONDS


@dataclass(frozen=True)
class ProcessEnd:
    returncode: int | None  # None when the worker stopped it
    timed_out: bool = False
    abandoned: bool = False  # stopped at the drain deadline, or killed because the lease was lost
    lease_lost: bool = False


def supervise(proc: subprocess.Popen, *, deadline: float, drain: Drain, kill_grace: float,
              held: Callable[[], bool]) -> ProcessEnd:
    """Wait for `proc` (started with start_new_session=True) until it exits, its timeout passes
    (`deadline`, on the monotonic clock: the step's begin + timeoutSeconds), the drain deadline
    does or the lease is lost (`held()` false); stop its whole process group in those cases — at
    once with SIGKILL for a lost lease, the next attempt may be about to start — and after an exit
    too, so nothing the step started outlives it."""
    while True:
        try:
            returncode = proc.wait(timeout=_POLL_SECONDS)
        except subprocess.TimeoutExpired:
            if not held():
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                return ProcessEnd(None, abandoned=True, lease_lost=True)
            now = time.monotonic()
            if now >= deadline:
                if not _stop_group(proc, kill_grace, held):
                    return ProcessEnd(None, abandoned=True, lease_lost=True)
                return ProcessEnd(None, timed_out=True)
            if drain.deadline is not None and now >= drain.deadline:
                if not _stop_group(proc, kill_grace, held):
                    return ProcessEnd(None, abandoned=True, lease_lost=True)
                return ProcessEnd(None, abandoned=True)
            continue
        _signal_group(proc.pid, signal.SIGKILL)
        return ProcessEnd(returncode)


def _stop_group(proc: subprocess.Popen, grace: float, held: Callable[[], bool]) -> bool:
    """SIGTERM the group (a python step sets its `cancelled` event), SIGKILL it after `grace` — at
    once if the lease is lost meanwhile (then False): the next attempt may be about to start."""
    _signal_group(proc.pid, signal.SIGTERM)
    until = time.monotonic() + grace
    still_held = True
    while (left := until - time.monotonic()) > 0:
        try:
            proc.wait(timeout=min(_POLL_SECONDS, left))
            break
        except subprocess.TimeoutExpired:
            if not held():
                still_held = False
                break
    _signal_group(proc.pid, signal.SIGKILL)  # also reaches grandchildren that outlived the leader
    proc.wait()
    return still_held


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
