"""Named crash points for the crash-point matrix: the process SIGKILLs (or SIGSTOPs) itself there.

`RETEX_FAILPOINT` arms one point: `point[:step][@task][=action]`

    after-effect                 the first time any step passes after-effect
    after-effect:charge          only in step `charge`
    after-admit@crash            only while handling the task named (or with the uid) `crash`
    after-effect:notify=stop     SIGSTOP instead of SIGKILL: a zombie, alive but frozen, until
                                 someone sends SIGCONT (crash-matrix R11)
    in-loop-round:relay=hang     the calling thread alone blocks for ever (the process lives on):
                                 a wedged operator loop, for the liveness probe
    in-loop-round:promoter=stop  the replica freezes in a round its leadership let start, before
                                 the round's first ledger write: resumed after a successor took
                                 the term, only the ledger's term fence stops that write
    in-lease-watch=raise         the calling thread alone raises FailpointRaised (the process lives
                                 on): a thread dead of a bug, for the liveness probe

The task scope matters where one process serves many tasks (the operator): without it, any task
passing the point trips it — including one resumed by kopf after a restart. A call site that
names no task never fires a scoped point. Just before the signal, one line on stderr names the
point, the step and the task, so a test can prove the fault fired where it meant it to:

    retex failpoint after-admit@crash fired: task=crash uid=1b2c... step=-: SIGKILL

Read once at import; a malformed or unknown spec is an error at once (a typo would otherwise
arm nothing and the test would wait for a death that never comes). Unset costs one comparison.

A process that is PID 1 of its PID namespace (a container's entrypoint: the worker in its pod)
cannot signal itself: the kernel drops the SIGKILL and SIGSTOP it sends to itself. There a kill
is `_exit(137)` — no cleanup runs, the kernel kills the rest of the namespace, and the runtime
reports 137 as for a SIGKILL — and a stop holds the thread that passes the point until SIGCONT
arrives: whoever waits for the line freezes the process from outside its namespace (SIGSTOP sent
from an ancestor namespace does reach PID 1; the e2e rigs' `pause_pod`), and the SIGCONT that
resumes it lets the thread go on, as a self-stopped process would. Between the line and that
SIGSTOP the process's other threads run on (a lease renewal may land): the point itself holds.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from dataclasses import dataclass

from retex.signalflag import SignalFlag

POINTS = frozenset({
    # operator
    "before-admit", "after-admit", "after-job-create", "in-status-mirror",
    "in-dispatch-batch",  # the relay's transaction holds its claims, nothing of the record sent yet
    # step: the loop's name (relay, promoter, reaper, status-mirror, status-resync, event-poster); past may_write
    "in-loop-round",
    # worker
    "after-lease", "before-step", "after-begin", "after-effect", "after-commit", "before-complete",
    # ledger, on a worker's behalf: it runs in the operator's ledger endpoint. in-commit: inside
    # the commit transaction; after-begin-commit: a begin committed, its reply not yet sent
    "in-commit", "after-begin-commit",
    # operator, the lease watch's thread (with =raise: it dies, as a bug in its error path made it)
    "in-lease-watch",
})
ACTIONS = {"kill": "SIGKILL", "stop": "SIGSTOP", "hang": "hang", "raise": "raise"}
_SPEC = re.compile(r"(?P<point>[a-z-]+)(?::(?P<step>[a-z0-9-]+))?(?:@(?P<task>[A-Za-z0-9.-]+))?(?:=(?P<action>[a-z]+))?")


class FailpointSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Armed:
    point: str
    step: str | None = None
    task: str | None = None  # a task's name or uid
    action: str = "kill"

    @property
    def label(self) -> str:
        """The spec without its action: what the fired line starts with."""
        return self.point + (f":{self.step}" if self.step else "") + (f"@{self.task}" if self.task else "")

    def matches(self, point: str, step: str | None, task: str | None, uid: str | None) -> bool:
        if point != self.point or (self.step and step != self.step):
            return False
        return self.task is None or self.task in (task, uid)


def parse(spec: str) -> Armed | None:
    """`point[:step][@task][=action]` → Armed; '' → None; anything else → FailpointSpecError."""
    if not spec:
        return None
    match = _SPEC.fullmatch(spec)
    if match is None:
        raise FailpointSpecError(f"RETEX_FAILPOINT={spec!r}: expected point[:step][@task][=action]")
    if match["point"] not in POINTS:
        raise FailpointSpecError(f"RETEX_FAILPOINT={spec!r}: unknown point {match['point']!r}; "
                                 f"known: {', '.join(sorted(POINTS))}")
    action = match["action"] or "kill"
    if action not in ACTIONS:
        raise FailpointSpecError(f"RETEX_FAILPOINT={spec!r}: unknown action {action!r}; known: {', '.join(ACTIONS)}")
    return Armed(point=match["point"], step=match["step"], task=match["task"], action=action)


def arm(spec: str, *, pid: int) -> Armed | None:
    """`parse(spec)` for the process `pid`. A stop in a process that is PID 1 listens for SIGCONT
    from here on (a handler must be in place before the line is printed, and only the main thread
    may install one; importing happens there)."""
    armed = parse(spec)
    if armed is not None and armed.action == "stop" and pid == 1:
        signal.signal(signal.SIGCONT, lambda signum, frame: _CONTINUED.set())
    return armed


def fired_line(armed: Armed, *, step: str | None, task: str | None, uid: str | None) -> str:
    return (f"retex failpoint {armed.label} fired: task={task or '-'} uid={uid or '-'} step={step or '-'}: "
            f"{ACTIONS[armed.action]}")


# Set by SIGCONT in a process that is PID 1 with a stop armed: frozen from outside and resumed.
_CONTINUED = SignalFlag()
_ARMED = arm(os.environ.get("RETEX_FAILPOINT", ""), pid=os.getpid())
# The exit status a container runtime reports for a process killed by SIGKILL.
_KILLED_STATUS = 128 + signal.SIGKILL


class FailpointRaised(RuntimeError):
    """What an armed point whose action is `raise` raises in the thread that passes it. An
    Exception like a bug's, on purpose: a broad `except Exception` around the point swallows it
    as it would the bug (docs/contributing/testing.md), so such a point goes where a bug would escape."""


def failpoint(point: str, step: str | None = None, *, task: str | None = None, uid: str | None = None) -> None:
    """Die (or freeze) here if this point is armed for this step and task."""
    if _ARMED is None or not _ARMED.matches(point, step, task, uid):
        return
    _CONTINUED.clear()
    print(fired_line(_ARMED, step=step, task=task, uid=uid), file=sys.stderr, flush=True)
    if _ARMED.action == "hang":
        threading.Event().wait()
    if _ARMED.action == "raise":
        raise FailpointRaised(f"failpoint {_ARMED.label}")
    if os.getpid() == 1:  # the signal it sent itself would be dropped
        if _ARMED.action == "stop":
            # For the SIGSTOP and SIGCONT of whoever read the line. Polled: Python runs a handler
            # in the main thread only, and a SIGCONT the kernel handed to another thread (the main
            # one had a SIGTERM pending) interrupts no sleep there.
            _CONTINUED.wait()
            return
        os._exit(_KILLED_STATUS)
    # To this thread, not the process: a process's signal goes to a thread of the kernel's choosing
    # (often the main one), and this thread would run on until that one had acted on it.
    signal.pthread_kill(threading.get_ident(), getattr(signal, ACTIONS[_ARMED.action]))
