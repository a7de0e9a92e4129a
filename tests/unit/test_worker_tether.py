"""A step's processes do not outlive a worker that is SIGKILLed mid-step (as they would not in a
pod), while a live worker still stops its steps gracefully."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retex.worker.attempt import DEADLINE_MARGIN_SECONDS
from retex.worker.calls import Supervision
from retex.worker.drain import Drain
from retex.worker.processes import Tether, own_deadline
from tests.unit.worker_steps_helpers import call, step

REPO = str(Path(__file__).resolve().parents[2])
# A stand-in worker: runs one step through the real runner, in this process's main thread, with
# the production SIGTERM grace. argv: kind, command or callable, timeout, the step's begin (the
# CLOCK_MONOTONIC moment, shared by every process on the host, its own deadline counts from).
WORKER = """
import os, sys
from tests.unit.worker_steps_helpers import call, step
from retex.worker import exec_step, python_step
from retex.worker.calls import Supervision
from retex.worker.drain import Drain
kind, arg, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 300
begun = {"begun": float(sys.argv[4])} if len(sys.argv) > 4 else {}
sup = Supervision(drain=Drain(30), env={**os.environ})
if kind == "exec":
    s = step(exec={"command": [sys.executable, "-c", arg]}, timeoutSeconds=timeout)
    exec_step.run(s.exec, s, call(**begun), sup)
else:
    s = step(python={"callable": arg}, timeoutSeconds=timeout)
    python_step.run(s.python, s, call(**begun), sup)
"""
# The step: writes its pid and a grandchild's pid, then both hang.
SPAWNER = ("import os, subprocess, sys, time\n"
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
           "open(os.environ['PIDS'], 'w').write(f'{os.getpid()} {child.pid}')\n"
           "time.sleep(600)\n")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout=3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("kind", ["exec", "python"])
def test_a_step_and_its_children_die_when_the_worker_is_killed(tmp_path, kind):
    pids_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": REPO, "PIDS": str(pids_file)}
    arg = SPAWNER if kind == "exec" else "tests.unit.worker_callables:spawn_and_hang"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, kind, arg], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 10
        while not (pids_file.exists() and pids_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        step_pids = [int(p) for p in pids_file.read_text().split()]
        assert all(alive(p) for p in step_pids)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        assert wait_gone(step_pids) == []
    finally:
        worker.kill()


@pytest.mark.parametrize("kind", ["exec", "python-slow-import"])
def test_a_step_of_a_paused_worker_still_dies_at_its_own_deadline_counted_from_its_begin(tmp_path, kind):
    # A SIGSTOPped worker cannot enforce the step timeout, yet the next attempt relies on the step
    # being dead by begin + timeoutSeconds + margin before it verifies: the group leader enforces
    # it by the host's monotonic clock from the begin, whatever the start-up or the import cost.
    pids_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": REPO, "PIDS": str(pids_file), "IMPORT_SECONDS": "3"}
    arg = SPAWNER if kind == "exec" else "tests.unit.worker_slow_import:spawn_and_hang"
    timeout = 5  # above the 3 s import: only the group leader's own deadline is measured
    begun = time.monotonic()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, kind.partition("-")[0], arg, str(timeout), str(begun)],
                              env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 10
        while not (pids_file.exists() and pids_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        step_pids = [int(p) for p in pids_file.read_text().split()]
        worker.send_signal(signal.SIGSTOP)
        assert wait_gone(step_pids, timeout=15) == []
        died = time.monotonic() - begun
        own = own_deadline(step(exec={"command": ["x"]}, timeoutSeconds=timeout), call(begun=0.0),
                           Supervision(drain=Drain(30)))
        assert own - 0.5 < died < own + KILL_LATENCY_SECONDS, f"died {died:.2f}s after its begin, own deadline {own}s"
    finally:
        worker.kill()
        worker.wait()


# How late a group leader's SIGKILL may land after its own deadline on a loaded host (its timer
# thread scheduled late): what the margin must still have room for.
KILL_LATENCY_SECONDS = 1.0


def test_a_steps_own_kill_lands_inside_the_margin_the_next_attempt_waits_out():
    # The next attempt verifies at begin + timeoutSeconds + DEADLINE_MARGIN_SECONDS (by the
    # database's clock, from started_at, which is no earlier than the worker's begin reading).
    s = step(exec={"command": ["x"]}, timeoutSeconds=7)
    own = own_deadline(s, call(begun=1000.0), Supervision(drain=Drain(30)))  # the production grace
    assert own - 1000.0 - s.timeout_seconds + KILL_LATENCY_SECONDS < DEADLINE_MARGIN_SECONDS


# A stand-in worker whose tether is started by a thread that then ends, then runs a step from its
# main thread; prints the parent of each step's command.
THREAD_THEN_MAIN = """
import threading
from tests.unit.worker_steps_helpers import call, step, supervision
from retex.worker import exec_step
s = step(exec={"command": ["sh", "-c", "grep PPid /proc/$$/status"]})
parents = []
starter = threading.Thread(target=lambda: parents.append(exec_step.run(s.exec, s, call(), supervision())))
starter.start()
starter.join()
parents.append(exec_step.run(s.exec, s, call(), supervision()))
print(" ".join(p.result["stdout"].split()[1] for p in parents))
"""


def test_the_tether_outlives_the_worker_thread_that_started_it():
    # The kernel's parent-death signal comes when the thread that started the tether ends, not
    # only with the worker: the tether must tell the two apart and keep serving the worker.
    out = subprocess.run([sys.executable, "-c", THREAD_THEN_MAIN], env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert len(out) == 2 and out[0] == out[1], out


def test_a_step_killed_at_its_own_deadline_is_reported_to_a_live_worker_and_the_tether_serves_on(tmp_path):
    # The worker may be alive but late (a loaded host): the tether's kill at the step's own
    # deadline is then the step's end, which the worker must hear of like any other.
    tether = Tether()
    out, err = tmp_path / "out", tmp_path / "err"
    out.touch()
    err.touch()
    step = tether.start(["sleep", "60"], env=dict(os.environ), stdout=out, stderr=err, deadline=time.monotonic() + 0.3)
    assert step.wait(timeout=10) == -signal.SIGKILL
    assert tether.start(["true"], env=dict(os.environ), stdout=out, stderr=err,
                        deadline=time.monotonic() + 60).wait(timeout=10) == 0
