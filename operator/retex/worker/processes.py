"""Child processes of steps: each in its own process group, so a timeout or the drain deadline
stops everything the step started, not just its first process. An exec step's group is started
by the worker's tether (`Tether`, `retex/worker/tether.py`), a python step's by the worker itself.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

from retex.api.models import Step
from retex.worker.drain import Drain
from retex.worker.supervision import StepCall, Supervision
from retex.worker.tether import Answer, StartRequest

_POLL_SECONDS = 0.05
LEASE_LOST = "lease lost (renew deadline passed, or taken): the step was killed"


# After the timeout and the worker's SIGTERM grace: a live worker's graceful stop comes first.
OWN_KILL_AFTER_GRACE_SECONDS = 1.0


def own_deadline(step: Step, call: StepCall, sup: Supervision) -> float:
    """When the step's group is SIGKILLed whatever the worker does (a SIGSTOPped worker enforces
    nothing), by the worker's tether (exec) or by the group's leader (python): a CLOCK_MONOTONIC
    moment, begin + timeout + grace + 1 s, inside the margin the next attempt waits out
    (attempt.DEADLINE_MARGIN_SECONDS)."""
    return call.begun + step.timeout_seconds + sup.kill_grace_seconds + OWN_KILL_AFTER_GRACE_SECONDS


class Waitable(Protocol):
    """A step's group leader, as `supervise` waits for it (subprocess.Popen's way)."""

    pid: int

    def wait(self, timeout: float | None = None) -> int: ...


class TetherLost(Exception):
    """The worker's tether ended, or stopped answering, while it held a step: the step's end is
    unknown (and, lost before it answered the start, whether it runs and under which pid)."""


# How long the worker waits for its tether to answer (the start of a step, or the end of one it
# has killed) before it gives up on it: a tether's start (an interpreter without site, tens of
# milliseconds, seconds on a loaded host) and a posix_spawn (a vfork and an exec), with room to
# spare — a live tether never comes near it — yet a worker stuck for ever could not act on a lost
# lease or its drain deadline.
TETHER_ANSWER_SECONDS = 30.0


# Run as a file with -I -S: no site-packages, no retex package, nothing from a step's working
# directory or environment (a module an earlier step wrote there is never imported).
_TETHER_FILE = str(Path(__file__).with_name("tether.py"))


class Tether:
    """The worker's side of its tether: started at the first step that needs it (again if it was
    lost), it starts each exec step's group and reports its end (protocol: retex/worker/tether.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending = b""
        self._answers: list[Answer] = []
        self._exited: dict[int, int] = {}

    def start(self, argv: list[str], *, env: dict[str, str], stdout: Path, stderr: Path,
              deadline: float) -> Waitable | ProcessEnd | str:
        """The step's group leader; or, if `deadline` (on the monotonic clock, when the tether
        SIGKILLs the group whatever the worker does) passed before it could start, its end (as
        a group killed then: nothing of it ran); or why its command cannot be started at all."""
        start: StartRequest = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(stdout),
                               "stderr": str(stderr), "deadline": deadline}
        request = json.dumps(start).encode() + b"\n"
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                # The old tether's reports are of pids the kernel may since have reused.
                self._proc, self._pending, self._answers, self._exited = self._spawn(), b"", [], {}
            assert self._proc.stdin is not None  # started with stdin=PIPE
            try:
                view = memoryview(request)
                while view:
                    view = view[os.write(self._proc.stdin.fileno(), view):]
            except BrokenPipeError:
                raise TetherLost("the worker's tether ended before it took the step") from None
            until = time.monotonic() + TETHER_ANSWER_SECONDS
            try:
                while not self._answers:
                    if (left := until - time.monotonic()) <= 0:
                        self._give_up()
                    self._read(left)
            except TetherLost as lost:
                # Its pid unknown, nothing here can kill the step: the attempt records an unknown
                # outcome (never a success), and the next attempt waits out the step's deadline.
                raise TetherLost(f"{lost}; it had not answered the start: the step may be running, "
                                 "its pid unknown") from None
            answer = self._answers.pop(0)
        if "refused" in answer:
            return answer["refused"]
        if "expired" in answer:
            return ProcessEnd(-signal.SIGKILL)
        if "killed" in answer:
            return ProcessEnd(-signal.SIGKILL, why=f"the worker's tether {answer['killed']}")
        return _StepProcess(self, answer["started"])

    def wait_for(self, pid: int, timeout: float | None) -> int:
        """Its exit code; `timeout` None: the group has been killed, so the tether answers at once,
        or within TETHER_ANSWER_SECONDS before the worker gives up on it (TetherLost)."""
        until = time.monotonic() + (TETHER_ANSWER_SECONDS if timeout is None else timeout)
        with self._lock:
            while pid not in self._exited:
                if (left := until - time.monotonic()) <= 0:
                    if timeout is None:
                        self._give_up()
                    raise subprocess.TimeoutExpired(str(pid), timeout)
                self._read(left)
            return self._exited.pop(pid)

    def _give_up(self) -> NoReturn:
        """A tether that does not answer is lost: its request pipe closed, it kills every group it
        started when it reads again (the next step gets a new tether)."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc = None
        raise TetherLost(f"the worker's tether has not answered for {TETHER_ANSWER_SECONDS:g}s")

    def _spawn(self) -> subprocess.Popen[bytes]:
        # Its own session: a signal to the worker's group (a pod's processes) does not reach it;
        # it learns of the worker's death from the kernel (PDEATHSIG) and from its pipe.
        return subprocess.Popen([sys.executable, "-I", "-S", _TETHER_FILE, str(os.getpid())], env={},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, start_new_session=True)

    def _read(self, timeout: float | None) -> None:
        """What the tether has said within `timeout`, filed by kind."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return
        data = os.read(fd, 1 << 16)
        if not data:
            raise TetherLost("the worker's tether ended: the step's group was killed, its outcome is unknown")
        self._pending += data
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            answer: Answer = json.loads(line)
            if "exited" in answer:
                self._exited[answer["exited"]] = answer["code"]
            else:
                if "started" in answer:  # a pid reused: an exit filed for it is an earlier process's
                    self._exited.pop(answer["started"], None)
                self._answers.append(answer)


class _StepProcess:
    def __init__(self, tether: Tether, pid: int):
        self.pid, self._tether = pid, tether
        self._returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self._returncode is None:
            try:
                self._returncode = self._tether.wait_for(self.pid, timeout)
            except TetherLost:
                _signal_group(self.pid, signal.SIGKILL)  # nobody else will now
                raise
        return self._returncode


@dataclass(frozen=True)
class ProcessEnd:
    returncode: int | None  # None when the worker stopped it
    timed_out: bool = False
    abandoned: bool = False  # stopped at the drain deadline, or killed because the lease was lost
    lease_lost: bool = False
    why: str | None = None  # why it was killed, when the command could not answer for itself


def supervise(proc: Waitable, *, deadline: float, drain: Drain, kill_grace: float,
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


def _stop_group(proc: Waitable, grace: float, held: Callable[[], bool]) -> bool:
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
