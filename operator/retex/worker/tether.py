"""Step processes die with their worker: `python -I -S tether.py WORKER_PID NOT_STARTED_FILE DEADLINE COMMAND...`.

In a pod, the end of the container kills every process in it. Run directly on a host — or on the
test rig, which has no PID namespaces — a step in its own process group would outlive a worker
that was SIGKILLed and could still perform its effect after the next attempt has moved on. So
every step's process group is led by a tethered process: it asks the kernel for SIGTERM when its
parent dies (PR_SET_PDEATHSIG) and then SIGKILLs its whole group. A SIGTERM sent by a live
worker (step timeout, drain deadline) is left to the step to handle, as before. And at DEADLINE,
a CLOCK_MONOTONIC moment (the step's begin + timeout + grace + 1 s, `processes.own_deadline`),
it SIGKILLs its group, so the step ends on time even while its worker is paused (SIGSTOP) and
cannot; the clock is the host's, so this process's start-up is not added to it.

If COMMAND cannot be started at all, the reason is written to NOT_STARTED_FILE: that is a
permanent failure, and it cannot be told from an exit code the command might use itself.

One of these starts for every exec step, so it is started as a file, isolated and without site
(`python -I -S`): only the standard library, no site-packages scan, no retex package, nothing of
the step's working directory or PYTHON* environment; and it starts COMMAND with posix_spawn, not
the subprocess module (whose import costs more than the rest of this process).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def tie_to(worker_pid: int, on_sigterm: Callable[[], None] | None = None) -> None:
    """Make this process (a step's group leader) take its group down when `worker_pid` dies."""

    def handle_sigterm(signum, frame) -> None:
        if os.getppid() != worker_pid:  # orphaned: the worker is gone
            os.killpg(0, signal.SIGKILL)
        if on_sigterm is not None:
            on_sigterm()

    signal.signal(signal.SIGTERM, handle_sigterm)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != worker_pid:  # it died before we asked to be told
        os.killpg(0, signal.SIGKILL)


def kill_group_at(deadline: float) -> None:
    """The step's own deadline (on time.monotonic()), kept by this process: a paused worker cannot
    stop its step, and the next attempt counts on it being dead by begin + timeoutSeconds + margin.
    Already passed (the worker was slow or paused before the step started): the group dies now,
    before any of the step's code runs."""
    left = deadline - time.monotonic()
    if left <= 0:
        os.killpg(0, signal.SIGKILL)
    timer = threading.Timer(left, os.killpg, args=(0, signal.SIGKILL))
    timer.daemon = True
    timer.start()


def main(argv: list[str]) -> int:
    worker_pid, not_started_file, deadline, command = int(argv[0]), argv[1], float(argv[2]), argv[3:]
    tie_to(worker_pid)
    kill_group_at(deadline)
    try:
        # Same stdio, environment and process group; the signals Python ignores (SIGPIPE, SIGXFSZ)
        # back to their defaults, as subprocess does.
        pid = os.posix_spawnp(command[0], command, os.environ, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as exc:
        with open(not_started_file, "w") as reason:
            reason.write(f"cannot start {command[0]!r}: {exc}")
        return 127
    returncode = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if returncode < 0:  # end the way the command did, so the worker sees the signal
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be handled anyway
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
