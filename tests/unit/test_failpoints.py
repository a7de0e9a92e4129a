"""Failpoints: the spec's grammar, task scoping, the line printed before the signal, and that every
call site names a known point (a misspelt point at a call site would never fire)."""

from __future__ import annotations

import ast
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retex.failpoints import POINTS, Armed, FailpointSpecError, fired_line, parse

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "retex"


def test_a_spec_names_point_step_task_and_action():
    assert parse("") is None
    assert parse("after-effect") == Armed("after-effect")
    assert parse("after-effect:charge") == Armed("after-effect", step="charge")
    assert parse("after-admit@crash") == Armed("after-admit", task="crash")
    assert parse("after-effect:notify@crash=stop") == Armed("after-effect", "notify", "crash", "stop")


@pytest.mark.parametrize(("spec", "says"), [
    ("after-efect", "unknown point 'after-efect'"),
    ("after-effect=pause", "unknown action 'pause'"),
    ("after-effect:Charge", "expected point[:step][@task][=action]"),
    ("after-admit@", "expected point[:step][@task][=action]"),
])
def test_a_malformed_or_unknown_spec_is_refused_with_what_was_wrong(spec, says):
    with pytest.raises(FailpointSpecError, match=f"RETEX_FAILPOINT='{spec}'.*{says}".replace("[", r"\[").replace("]", r"\]")):
        parse(spec)


def test_a_task_scope_matches_the_tasks_name_or_uid_and_nothing_unscoped():
    armed = parse("after-admit@crash")
    assert armed.matches("after-admit", None, task="crash", uid="u-1")
    assert parse("after-admit@u-1").matches("after-admit", None, task="crash", uid="u-1")
    assert not armed.matches("after-admit", None, task="control", uid="u-2"), "another task passes unharmed"
    assert not armed.matches("after-admit", None, task=None, uid=None), "a call site naming no task never fires"
    assert not armed.matches("before-admit", None, task="crash", uid="u-1")


def test_a_step_scope_matches_that_step_only():
    armed = parse("after-effect:charge")
    assert armed.matches("after-effect", "charge", task="t", uid="u")
    assert not armed.matches("after-effect", "ship", task="t", uid="u")


def test_the_fired_line_names_point_task_and_signal():
    line = fired_line(parse("after-admit@crash"), step=None, task="crash", uid="u-1")
    assert line == "retex failpoint after-admit@crash fired: task=crash uid=u-1 step=-: SIGKILL"


def _run_with(spec: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RETEX_FAILPOINT": spec}
    return subprocess.run([sys.executable, "-c", f"from retex.failpoints import failpoint\n{code}\nprint('survived')"],
                          env=env, capture_output=True, text=True, timeout=30)


def test_an_armed_point_sigkills_its_process_after_printing_the_line():
    done = _run_with("after-admit@crash", "failpoint('after-admit', task='control', uid='u-2')\n"
                                          "failpoint('after-admit', task='crash', uid='u-1')")
    assert done.returncode == -signal.SIGKILL
    assert done.stderr.strip() == "retex failpoint after-admit@crash fired: task=crash uid=u-1 step=-: SIGKILL"
    assert "survived" not in done.stdout


def _run_as_pid_1(spec, code):
    """`code` in a process that is PID 1 of its own PID namespace, as a container's entrypoint is:
    the kernel drops the SIGKILL and SIGSTOP such a process sends itself."""
    env = {**os.environ, "RETEX_FAILPOINT": spec}
    program = f"import os\nassert os.getpid() == 1, os.getpid()\nfrom retex.failpoints import failpoint\n{code}\nprint('survived')"
    return subprocess.run(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", program],
                          env=env, capture_output=True, text=True, timeout=30)


def test_an_armed_point_kills_a_process_that_is_pid_1_as_a_sigkill_would():
    done = _run_as_pid_1("after-effect", "failpoint('after-effect', 'charge', task='t', uid='u')")
    assert "assert os.getpid() == 1" not in done.stderr, done.stderr
    assert done.stderr.strip() == "retex failpoint after-effect fired: task=t uid=u step=charge: SIGKILL"
    assert "survived" not in done.stdout
    assert done.returncode == 128 + signal.SIGKILL  # what a container runtime reports for a SIGKILL


def test_a_stop_point_in_a_process_that_is_pid_1_holds_until_frozen_and_resumed_from_outside():
    """PID 1 cannot stop itself: the point holds its thread, the test (outside the namespace, as
    the e2e rigs' `pause_pod`) freezes and resumes it, and only then does it go on."""
    env = {**os.environ, "RETEX_FAILPOINT": "after-effect:notify=stop"}
    program = ("import os\nassert os.getpid() == 1, os.getpid()\nfrom retex.failpoints import failpoint\n"
               "failpoint('after-effect', 'notify', task='t', uid='u')\nprint('went on', flush=True)")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", program],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert first.strip() == "retex failpoint after-effect:notify fired: task=t uid=u step=notify: SIGSTOP", \
            first + proc.stderr.read()
        inner = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])

        def state() -> str:
            return Path(f"/proc/{inner}/stat").read_text().rsplit(")", 1)[1].split()[0]

        time.sleep(1)
        # The hold wakes every 0.05 s, so under load it may be caught running ("R"): held means
        # not stopped, not exited and nothing printed after the point.
        assert state() in ("S", "R") and proc.poll() is None, "held at the point, not gone on"
        assert select.select([proc.stdout], [], [], 0)[0] == [], "held at the point, not gone on"
        os.kill(inner, signal.SIGSTOP)  # from the parent namespace: it reaches PID 1
        deadline = time.monotonic() + 10
        while state() != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state() == "T", "frozen from outside"
        os.kill(inner, signal.SIGCONT)
        assert proc.stdout.read().strip() == "went on"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stop_point_in_pid_1_goes_on_whichever_line_of_its_hold_the_sigcont_lands_on():
    """The SIGCONT's handler runs between two bytecodes of whatever the hold is doing. Here it is
    made pending at the k-th traced line after the point's line, for every k over the hold's loop:
    a handler that took a lock the hold can be holding (an Event's) deadlocked at one of them."""
    code = """
import signal, sys
class Stderr:
    written = False
    def write(self, text): Stderr.written = True
    def flush(self): pass
sys.stderr = Stderr()
for k in range(1, 20):
    Stderr.written, lines = False, 0
    def trace(frame, event, arg):
        global lines
        if event == "line" and Stderr.written:
            lines += 1
            if lines == k:
                os.kill(os.getpid(), signal.SIGCONT)
        return trace
    sys.settrace(trace)
    failpoint('after-effect', 'notify', task='t', uid='u')
    sys.settrace(None)
    assert Stderr.written, 'the point did not fire'
    print('went on after line', k, flush=True)
"""
    done = _run_as_pid_1("after-effect:notify=stop", code)
    assert done.stdout.splitlines() == [f"went on after line {k}" for k in range(1, 20)] + ["survived"], done.stdout


def test_a_pid_1_stop_goes_on_when_its_sigcont_lands_on_another_thread():
    """The kernel hands a process's SIGCONT to any thread (another one when the main thread has a
    signal pending, as a SIGTERM sent while it was stopped): the point's wait must still end."""
    program = ("import signal, threading, time\n"
               "def other():\n"
               "    time.sleep(1)\n"
               "    signal.pthread_kill(threading.get_ident(), signal.SIGCONT)  # lands on this thread\n"
               "threading.Thread(target=other).start()\n"
               "failpoint('after-effect', 'notify', task='t', uid='u')\n"
               "print('went on')")
    done = _run_as_pid_1("after-effect:notify=stop", program)
    assert "assert os.getpid() == 1" not in done.stderr, done.stderr
    assert done.stderr.strip().endswith("step=notify: SIGSTOP"), done.stderr
    assert "went on" in done.stdout and done.returncode == 0


def test_a_raise_point_raises_in_the_thread_that_passes_it_and_the_process_lives_on():
    done = _run_with("in-lease-watch=raise", "import threading\n"
                                             "threading.Thread(target=failpoint, args=('in-lease-watch',)).start()")
    assert done.returncode == 0 and "survived" in done.stdout
    assert done.stderr.startswith("retex failpoint in-lease-watch fired: task=- uid=- step=-: raise\n")
    assert "FailpointRaised: failpoint in-lease-watch" in done.stderr


def test_a_stop_point_freezes_the_process_until_sigcont_then_it_goes_on():
    env = {**os.environ, "RETEX_FAILPOINT": "after-effect:notify=stop"}
    proc = subprocess.Popen([sys.executable, "-c", "from retex.failpoints import failpoint\n"
                             "failpoint('after-effect', 'notify', task='t', uid='u')\nprint('went on')"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert first.strip().endswith(": SIGSTOP"), first
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), "frozen at the point"
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.stdout.read().strip() == "went on"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _writes_past_a_stop_point(after: Path) -> int:
    """A thread passes a stop point, then writes to `after`, while the main thread wakes every
    millisecond (an event loop: the operator's kopf). Returns what it wrote before the process
    stopped; then resumes it and checks it went on."""
    program = ("import os, threading, time\n"
               "from retex.failpoints import failpoint\n"
               "def passing():\n"
               f"    fd = os.open({str(after)!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
               "    time.sleep(0.3)  # the main thread in its loop\n"
               "    failpoint('after-effect', 'notify', task='t', uid='u')\n"
               "    for _ in range(100000):\n"
               "        os.write(fd, b'x')\n"
               "    os._exit(0)\n"
               "threading.Thread(target=passing).start()\n"
               "while True:\n"
               "    time.sleep(0.001)\n")
    env = {**os.environ, "RETEX_FAILPOINT": "after-effect:notify=stop"}
    proc = subprocess.Popen([sys.executable, "-c", program], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr.readline().strip().endswith(": SIGSTOP")
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), "frozen at the point"
        written = after.stat().st_size
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=30) == 0 and after.stat().st_size == 100000
        return written
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stop_point_holds_the_thread_that_passes_it_while_the_main_thread_wakes_often(tmp_path):
    """The thread past the point runs nothing more before the process is stopped. A stop sent to
    the process goes to a thread of the kernel's choosing (here the main one), and the others stop
    only once that one has acted: the thread past the point ran on meanwhile (thousands of writes
    in most tries; a relay frozen inside its claim transaction committed it first)."""
    written = [_writes_past_a_stop_point(tmp_path / f"after-{i}") for i in range(3)]
    assert written == [0, 0, 0], f"writes past the point before the process stopped, per try: {written}"


def test_a_malformed_spec_stops_the_process_at_import():
    done = _run_with("before-admt", "")
    assert done.returncode == 1
    assert "FailpointSpecError: RETEX_FAILPOINT='before-admt': unknown point" in done.stderr


def _call_sites() -> list[tuple[Path, ast.Call]]:
    return [(path, node) for path in OPERATOR.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "failpoint"]


def test_every_call_site_names_a_known_point_and_every_point_has_a_call_site():
    assert {node.args[0].value for _, node in _call_sites()} == POINTS


def test_every_call_site_passes_its_task_so_a_scoped_point_can_fire_there():
    for path, node in _call_sites():
        if node.args[0].value in ("in-loop-round", "in-lease-watch"):  # for every task at once: no task scope
            assert not node.keywords, f"{path.name}:{node.lineno}"
            continue
        assert {k.arg for k in node.keywords} == {"task", "uid"}, f"{path.name}:{node.lineno}"


def test_a_hang_blocks_only_the_calling_thread_and_the_process_lives_on():
    code = ("import threading\n"
            "t = threading.Thread(target=failpoint, args=('in-loop-round', 'relay'), daemon=True)\n"
            "t.start(); t.join(2)\n"
            "assert t.is_alive(), 'the thread did not hang'\n"
            "failpoint('in-loop-round', 'reaper')  # another loop passes unharmed")
    done = _run_with("in-loop-round:relay=hang", code)
    assert done.returncode == 0, done.stderr
    assert "retex failpoint in-loop-round:relay fired: task=- uid=- step=relay: hang" in done.stderr
    assert "survived" in done.stdout
