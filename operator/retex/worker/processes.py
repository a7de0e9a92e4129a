"""Child processes of steps: each in its own process group, so a timeout or the drain deadline
stops everything the step started, not just its first process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

from retex.worker.drain import Drain

_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class ProcessEnd:
    returncode: int | None  # None when the worker stopped it
    timed_out: bool = False
    abandoned: bool = False  # stopped at the drain deadline


def supervise(proc: subprocess.Popen, *, timeout: float, drain: Drain, kill_grace: float) -> ProcessEnd:
    """Wait for `proc` (started with start_new_session=True) until it exits, its timeout passes or
    the drain deadline does; stop its whole process group in the last two cases, and after an
    exit too, so nothing the step started outlives it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            returncode = proc.wait(timeout=_POLL_SECONDS)
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if now >= deadline:
                stop_group(proc, kill_grace)
                return ProcessEnd(None, timed_out=True)
            if drain.deadline is not None and now >= drain.deadline:
                stop_group(proc, kill_grace)
                return ProcessEnd(None, abandoned=True)
            continue
        _signal_group(proc.pid, signal.SIGKILL)
        return ProcessEnd(returncode)


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the group (a python step sets its `cancelled` event), SIGKILL it after `grace`."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)  # also reaches grandchildren that outlived the leader
    proc.wait()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
