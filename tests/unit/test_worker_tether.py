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
from retex.worker.drain import Drain
from retex.worker.processes import Tether, own_deadline
from retex.worker.supervision import Supervision
from tests.unit.worker_steps_helpers import call, step

REPO = str(Path(__file__).resolve().parents[2])
# A stand-in worker: runs one step through the real runner, in this process's main thread, with
# the production SIGTERM grace. argv: kind, command or callable, timeout, the step's begin (the
# CLOCK_MONOTONIC moment, shared by every process on the host, its own deadline counts from).
WORKER = """
import os, sys
from tests.unit.worker_steps_helpers import call, step
from retex.worker.steps import exec_step, python_step
from retex.worker.supervision import Supervision
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
from retex.worker.steps import exec_step
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


# --- the tether's failure paths (review of the one-tether-per-worker merge) ---------------------

TETHER_FILE = str(Path(__file__).resolve().parents[2] / "operator" / "retex" / "worker" / "tether.py")
# The tether with os.pidfd_open failing (ENOSYS, a kernel before 5.3) for the steps it starts
# only (PROBE_TOO: for its own pid too), run the way the worker runs it.
NO_PIDFD = """
import errno, os, runpy, sys
real, probe_too = os.pidfd_open, sys.argv.pop(1) == "yes"
def pidfd_open(pid, *flags):
    if pid == os.getpid() and not probe_too:
        return real(pid, *flags)
    raise OSError(errno.ENOSYS, "Function not implemented")
os.pidfd_open = pidfd_open
sys.argv[0] = {file!r}
runpy.run_path({file!r}, run_name="__main__")
"""


class _WrappedTether(Tether):
    """A worker's tether run through `wrapper` (python -c wrapper ARGS... WORKER_PID)."""

    def __init__(self, wrapper: str, *args: str):
        super().__init__()
        self._wrapper = [sys.executable, "-I", "-S", "-c", wrapper, *args]

    def _spawn(self):
        self.spawned = subprocess.Popen([*self._wrapper, str(os.getpid())], env={}, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, bufsize=0, start_new_session=True)
        return self.spawned


def files(tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    out.touch()
    err.touch()
    return {"env": dict(os.environ), "stdout": out, "stderr": err}


def test_a_step_whose_pidfd_cannot_be_opened_is_killed_and_its_end_unknown_and_the_tether_serves_on(tmp_path):
    from retex.worker.processes import ProcessEnd
    touched = tmp_path / "touched"
    tether = _WrappedTether(NO_PIDFD.format(file=TETHER_FILE), "no")
    end = tether.start(["sh", "-c", f"sleep 0.5; touch {touched}"], deadline=time.monotonic() + 60, **files(tmp_path))
    assert isinstance(end, ProcessEnd) and end.returncode == -signal.SIGKILL and end.why, end
    time.sleep(1.0)
    assert not touched.exists(), "the step ran on after its tether lost track of it"
    assert tether._proc.poll() is None, "the tether ended"


def test_a_step_whose_pidfd_cannot_be_opened_is_an_unknown_outcome_never_a_success(tmp_path, monkeypatch):
    from retex.worker.outcomes import Unknown, VerifyFailed
    from retex.worker.steps import exec_step
    from tests.unit.worker_steps_helpers import supervision
    monkeypatch.setattr(exec_step, "TETHER", _WrappedTether(NO_PIDFD.format(file=TETHER_FILE), "no"))
    s = step(exec={"command": ["true"]})
    assert isinstance(exec_step.run(s.exec, s, call(), supervision()), Unknown)
    assert isinstance(exec_step.verify(s.exec, s, call(), supervision()), VerifyFailed)


def test_a_tether_without_pidfd_open_starts_nothing(tmp_path):
    from retex.worker.processes import TetherLost
    touched = tmp_path / "touched"
    tether = _WrappedTether(NO_PIDFD.format(file=TETHER_FILE), "yes")
    with pytest.raises(TetherLost, match="may be running"):
        tether.start(["touch", str(touched)], deadline=time.monotonic() + 60, **files(tmp_path))
    time.sleep(0.5)
    assert not touched.exists()


def test_a_tether_that_fails_kills_every_step_it_started(tmp_path):
    tether = Tether()
    step_proc = tether.start(["sleep", "600"], deadline=time.monotonic() + 600, **files(tmp_path))
    os.write(tether._proc.stdin.fileno(), b"not a request\n")  # anything that makes it raise
    assert tether._proc.wait(timeout=10) != 0
    assert wait_gone([step_proc.pid]) == []


def test_a_step_whose_deadline_has_passed_is_not_started(tmp_path):
    from retex.worker.processes import ProcessEnd
    touched = tmp_path / "touched"
    end = Tether().start(["touch", str(touched)], deadline=time.monotonic() - 1, **files(tmp_path))
    assert isinstance(end, ProcessEnd) and end.returncode == -signal.SIGKILL, end
    time.sleep(0.3)
    assert not touched.exists()


def test_what_a_step_left_behind_dies_when_its_leader_exits_though_the_worker_never_waits(tmp_path):
    # A paused worker does not wait for its step: the tether, seeing the leader exit, kills the group.
    child = tmp_path / "child"
    Tether().start(["sh", "-c", f"sleep 600 & echo $! > {child}"], deadline=time.monotonic() + 600, **files(tmp_path))
    deadline = time.monotonic() + 10
    while not (child.exists() and child.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert wait_gone([int(child.read_text())]) == []


def test_sigterm_is_blocked_while_a_step_is_spawned_and_not_yet_on_the_list_the_tether_kills(tmp_path, monkeypatch):
    # The worker's death (PDEATHSIG: SIGTERM) between the spawn and the list would leave the step
    # running: the tether holds SIGTERM off until the step is on it.
    from retex.worker import tether as tether_module
    masks, real = [], os.posix_spawnp

    def spawn(*args, **kwargs):
        masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, "posix_spawnp", spawn)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # the tether sets its own PATH to the step's
    steps = tether_module._Steps(os.getppid(), orphaned=lambda: None)
    answer = steps.start({"argv": ["true"], "env": dict(os.environ), "cwd": os.getcwd(), "stdout": os.devnull,
                          "stderr": os.devnull, "deadline": time.monotonic() + 60})
    os.waitpid(answer["started"], 0)
    assert signal.SIGTERM in masks[0]
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_request_left_in_the_pipe_by_a_dead_worker_starts_nothing(tmp_path, monkeypatch):
    from retex.worker import tether as tether_module
    orphaned = []
    monkeypatch.setattr(os, "posix_spawnp", lambda *a, **k: pytest.fail("spawned for a dead worker"))
    steps = tether_module._Steps(os.getppid() + 1, orphaned=lambda: orphaned.append(True) or sys.exit(1))
    with pytest.raises(SystemExit):
        steps.start({"argv": ["true"], "env": dict(os.environ), "cwd": os.getcwd(), "stdout": os.devnull,
                     "stderr": os.devnull, "deadline": time.monotonic() + 60})
    assert orphaned


# --- the worker's side ----------------------------------------------------------------------------

class _FakeTetherOutput:
    def __init__(self):
        self.read_end, self.write_end = os.pipe()
        self.stdout = os.fdopen(self.read_end, "rb", buffering=0)

    def poll(self):
        return None


def test_an_exit_filed_for_a_pid_is_forgotten_when_the_pid_is_started_again():
    # The kernel reuses pids: an exit the worker never waited for must not end a new step at once.
    tether, fake = Tether(), _FakeTetherOutput()
    tether._proc = fake
    os.write(fake.write_end, b'{"exited": 4242, "code": 0}\n{"started": 4242}\n')
    tether._read(1)
    with pytest.raises(subprocess.TimeoutExpired):
        tether.wait_for(4242, 0.1)


def test_a_new_tether_forgets_the_exits_its_predecessor_reported(tmp_path):
    tether = Tether()
    tether.start(["true"], deadline=time.monotonic() + 60, **files(tmp_path)).wait(timeout=10)
    tether._exited[4242] = 0  # reported by the old tether, never waited for
    tether._proc.kill()
    tether._proc.wait()
    tether.start(["true"], deadline=time.monotonic() + 60, **files(tmp_path)).wait(timeout=10)
    assert 4242 not in tether._exited


STUCK = "import sys, time; sys.stdin.readline(); time.sleep(600)"


@pytest.mark.parametrize("waiting_for", ["start", "exit"])
def test_a_stuck_tether_is_given_up_on_in_bounded_time(tmp_path, monkeypatch, waiting_for):
    # A worker blocked on its tether cannot act on a lost lease: it gives up and the step's end is unknown.
    import threading

    from retex.worker import processes
    from retex.worker.processes import TetherLost
    monkeypatch.setattr(processes, "TETHER_ANSWER_SECONDS", 0.5, raising=False)
    tether = _WrappedTether(STUCK)
    raised = []

    def wait():
        try:
            if waiting_for == "start":
                tether.start(["true"], deadline=time.monotonic() + 60, **files(tmp_path))
            else:
                tether._proc = tether._spawn()
                tether.wait_for(4242, None)
        except TetherLost as lost:
            raised.append(lost)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(5)
    try:
        assert not waiter.is_alive() and raised, "the worker waits on a stuck tether for ever"
    finally:
        tether.spawned.kill()
        tether.spawned.wait()
