"""Step processes die with their worker: `python -I -S tether.py WORKER_PID`, one per worker.

In a pod, the end of the container kills every process in it. Run directly on a host — or on the
test rig, which has no PID namespaces — a step in its own process group would outlive a worker
that was SIGKILLed and could still perform its effect after the next attempt has moved on. So
every exec step's process group is started by the worker's tether, a process of its own session
that asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG) and then SIGKILLs every
group it started; it does the same when the worker's end of its request pipe closes. A SIGTERM
sent by a live worker to a step's group (step timeout, drain deadline) is left to the step to
handle, as before: the tether is not in that group. And at each step's DEADLINE, a
CLOCK_MONOTONIC moment (the step's begin + timeout + grace + 1 s, `processes.own_deadline`), it
SIGKILLs that step's group, so the step ends on time even while its worker is paused (SIGSTOP)
and cannot; the clock is the host's, so no start-up is added to it.

The protocol, one JSON object a line: the worker writes {"argv", "env", "cwd", "stdout",
"stderr", "deadline"} to the tether's stdin; the tether answers on its stdout {"started": PID}
(PID leads the step's new session and group), {"refused": WHY} (the command cannot be started
at all: a permanent failure, which an exit code the command might use itself could not tell) or
{"expired": true} (its deadline passed before it could start: nothing of it ran), {"killed":
WHY} (it was started but could not be watched — pidfd_open failed —, so its group was SIGKILLed
and reaped at once: what it did is unknown); and later
{"exited": PID, "code": CODE} (negative: the signal that ended it), once it has SIGKILLed
whatever of the group is left, so nothing the step started outlives it.

It is started once, at the worker's first exec step, not once a step: an interpreter start was
most of a no-op step's cost (docs/benchmarks.md). It runs as a file, isolated and without site
(`python -I -S`): only the standard library, no site-packages, no retex package, nothing of a
step's working directory or PYTHON* environment; and it starts commands with posix_spawn. It
needs pidfd_open (Linux >= 5.3): it checks it at start and exits, having started nothing, without
it. Whatever ends it, it SIGKILLs every group it started first.

`tie_to` and `kill_group_at` also serve a python step's child, which leads its own group
(`retex.worker.steps.pycall`).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TypedDict

_PR_SET_PDEATHSIG = 1


class StartRequest(TypedDict):
    """The worker's request to start a step's group (on the monotonic clock, `deadline`)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    stdout: str
    stderr: str
    deadline: float


class Answer(TypedDict, total=False):
    """One line of the tether's: exactly one of started, refused, expired, killed or exited (with code)."""

    started: int
    refused: str
    expired: bool
    killed: str
    exited: int
    code: int


def tie_to(worker_pid: int, on_sigterm: Callable[[], None] | None = None,
           orphaned: Callable[[], None] = lambda: os.killpg(0, signal.SIGKILL)) -> None:
    """Make this process call `orphaned` (by default: SIGKILL its own group, which it leads) when
    `worker_pid` dies; a SIGTERM while the worker lives calls `on_sigterm`."""

    def handle_sigterm(signum: int, frame: FrameType | None) -> None:
        # PDEATHSIG also comes when the worker's thread that started this process ends: only a
        # parent that is no longer the worker means the worker is gone.
        if os.getppid() != worker_pid:
            orphaned()
        if on_sigterm is not None:
            on_sigterm()

    signal.signal(signal.SIGTERM, handle_sigterm)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != worker_pid:  # it died before we asked to be told
        orphaned()


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


class _Steps:
    """The groups this tether started and has not seen end: pid → (pidfd, deadline), the
    deadline None once the group has been killed at it."""

    def __init__(self, worker_pid: int, orphaned: Callable[[], None]) -> None:
        self.running: dict[int, tuple[int, float | None]] = {}
        self.worker_pid, self.orphaned = worker_pid, orphaned

    def kill_all(self) -> None:
        for pid in self.running:
            _kill_group(pid)

    def start(self, request: StartRequest) -> Answer:
        # PATH as the step's environment has it: posix_spawnp looks the command up in this
        # process's own (as the command's own exec would have).
        if "PATH" in request["env"]:
            os.environ["PATH"] = request["env"]["PATH"]
        else:
            os.environ.pop("PATH", None)
        if request["deadline"] <= time.monotonic():  # the worker was paused past it: run nothing
            return {"expired": True}
        command = request["argv"]
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 1, request["stdout"], os.O_WRONLY | os.O_APPEND, 0),
                   (os.POSIX_SPAWN_OPEN, 2, request["stderr"], os.O_WRONLY | os.O_APPEND, 0)]
        # SIGTERM (the worker's death) held off until the group is on the list it kills.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            os.chdir(request["cwd"])
            if os.getppid() != self.worker_pid:  # a request the worker wrote before it died
                self.orphaned()
            # Its own session and group; the signals Python ignores (SIGPIPE, SIGXFSZ) back to
            # their defaults, as subprocess does; no signal blocked.
            try:
                pid = os.posix_spawnp(command[0], command, request["env"], file_actions=actions, setsid=True,
                                      setsigdef=(signal.SIGPIPE, signal.SIGXFSZ), setsigmask=())
            except OSError as exc:
                return {"refused": f"cannot start {command[0]!r}: {exc}"}
            try:
                self.running[pid] = (os.pidfd_open(pid), request["deadline"])
            except BaseException as exc:
                # It runs, and this tether could not see it end: it dies now, not at its deadline;
                # what it did first is unknown (not a refusal: nothing says a retry would fail).
                _kill_group(pid)
                os.waitpid(pid, 0)
                if not isinstance(exc, Exception):
                    raise
                return {"killed": f"started {command[0]!r} but could not watch it ({exc}): killed at once"}
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return {"started": pid}

    def ended(self, pid: int) -> Answer:
        """The group's leader has exited (not yet reaped, so its group id cannot be reused)."""
        _kill_group(pid)  # before it leaves the list the worker's death would kill
        pidfd, _ = self.running.pop(pid)
        os.close(pidfd)
        return {"exited": pid, "code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def serve(worker_pid: int, requests: int, replies: int) -> int:
    # pidfd_open (Linux >= 5.3) is how a step's end is seen: without it, fail before starting any.
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        print(f"retex tether: os.pidfd_open is unavailable ({exc}): no exec step can run here "
              "(Linux >= 5.3 needed)", file=sys.stderr)
        return 2

    def orphaned() -> None:
        steps.kill_all()
        os._exit(1)

    steps = _Steps(worker_pid, orphaned)
    try:
        tie_to(worker_pid, orphaned=orphaned)
        return _serve(steps, requests, replies, orphaned)
    finally:  # whatever ended it: nothing it started outlives it
        steps.kill_all()


def _serve(steps: _Steps, requests: int, replies: int, orphaned: Callable[[], None]) -> int:
    pending = b""
    while True:
        deadlines = [deadline for _, deadline in steps.running.values() if deadline is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        pidfds = {pidfd: pid for pid, (pidfd, _) in steps.running.items()}
        readable, _, _ = select.select([requests, *pidfds], [], [], timeout)
        answers = [steps.ended(pidfds[fd]) for fd in readable if fd in pidfds]
        for pid, (pidfd, deadline) in list(steps.running.items()):
            if deadline is not None and deadline <= time.monotonic():
                _kill_group(pid)
                steps.running[pid] = (pidfd, None)  # its end is reported when its pidfd is readable
        if requests in readable:
            data = os.read(requests, 1 << 16)
            if not data:  # the worker closed its end, or died
                orphaned()
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                answers.append(steps.start(json.loads(line)))
        try:
            for answer in answers:
                os.write(replies, json.dumps(answer).encode() + b"\n")
        except BrokenPipeError:
            orphaned()


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), sys.stdin.fileno(), sys.stdout.fileno()))
