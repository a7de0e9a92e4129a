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

REPO = str(Path(__file__).resolve().parents[2])
# A stand-in worker: runs one step through the real runner, in this process's main thread.
WORKER = """
import sys
from tests.unit.worker_steps_helpers import call, step, supervision
from retex.worker import exec_step, python_step
kind, arg, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 300
if kind == "exec":
    s = step(exec={"command": [sys.executable, "-c", arg]}, timeoutSeconds=timeout)
    exec_step.run(s.exec, s, call(), supervision(env={**__import__("os").environ}))
else:
    s = step(python={"callable": arg}, timeoutSeconds=timeout)
    python_step.run(s.python, s, call(), supervision(env={**__import__("os").environ}))
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


@pytest.mark.parametrize("kind", ["exec", "python"])
def test_a_step_of_a_paused_worker_still_dies_at_its_own_deadline(tmp_path, kind):
    # A SIGSTOPped worker cannot enforce the step timeout, yet the next attempt relies on the step
    # being dead by begin + timeoutSeconds + margin before it verifies: the tether enforces it.
    pids_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": REPO, "PIDS": str(pids_file)}
    arg = SPAWNER if kind == "exec" else "tests.unit.worker_callables:spawn_and_hang"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, kind, arg, "2"], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 10
        while not (pids_file.exists() and pids_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        step_pids = [int(p) for p in pids_file.read_text().split()]
        worker.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        assert wait_gone(step_pids, timeout=10) == []
        # The tether kills at timeout + grace + 1 s from the step's start (3.5 s here); what the
        # next attempt relies on is that this falls inside begin + timeout + the margin it waits.
        assert time.monotonic() - paused < 2 + DEADLINE_MARGIN_SECONDS
    finally:
        worker.kill()
        worker.wait()
