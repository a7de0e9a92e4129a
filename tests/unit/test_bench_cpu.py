"""The bench's CPU accounting from /proc (e2e/cpu.py): the counters read right, a process counted
once whether it is still running, was born in the window, or was reaped in it."""

import subprocess
import sys
import time
from pathlib import Path

from e2e.cpu import TICKS, CpuAccount, ProcStat, _Seen, account, busy_ticks, group_of, parse_stat


def stat_line(pid, comm, ppid, utime, stime, cutime, cstime, start):
    # fields 1..22 of /proc/<pid>/stat; the ones not read are zeros
    rest = ["S", ppid, 0, 0, 0, 0, 0, 0, 0, 0, 0, utime, stime, cutime, cstime, 0, 0, 0, 0, start, 0, 0]
    return f"{pid} ({comm}) " + " ".join(str(v) for v in rest)


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields():
    parsed = parse_stat(stat_line(7, "a (b) c", 3, 11, 12, 13, 14, 99))
    assert parsed == ProcStat(ppid=3, own_ticks=23, children_ticks=27, start=99)


def test_busy_ticks_leave_out_idle_and_iowait():
    assert busy_ticks("cpu  1 2 3 1000 2000 4 5 6 0 0\ncpu0 1 1 1 1 1 1 1 1\n") == 1 + 2 + 3 + 4 + 5 + 6


def test_processes_fall_in_their_groups_and_an_unnamed_one_in_none():
    assert group_of(["postgres: retex bench_x 127.0.0.1(5432) idle"]) == "postgres"
    assert group_of(["/usr/lib/postgresql/15/bin/postgres", "-D", "/data"]) == "postgres"
    assert group_of(["/venv/bin/python", "/venv/bin/retex-operator", "--health", "x"]) == "operator"
    assert group_of(["/usr/local/bin/python", "-I", "-S", "/app/retex/worker/tether.py", "12"]) == "worker and its steps"
    assert group_of(["/usr/local/bin/kube-apiserver", "--etcd-servers=x"]) == "kube-apiserver"
    assert group_of(["/bin/bash", "/usr/local/bin/node-cni.sh"]) == "kind's node-cni loop"
    assert group_of(["true"]) is None
    assert group_of([]) is None


def seen(pid, argv, ppid, first, last, *, gone=False, start=None):
    start = pid if start is None else start
    return _Seen(pid, argv, ProcStat(ppid, first[0], first[1], start), ProcStat(ppid, last[0], last[1], start), gone)


def test_a_reaped_child_is_counted_once_in_its_own_group_and_an_unseen_one_in_its_reapers():
    processes = {
        # the worker: 10 ticks of its own; its children's time grew by 40: a step it reaped whose
        # lifetime was 25 ticks when last seen, and 15 ticks of steps too short to be seen
        (2, 2): seen(2, ["retex-worker"], 1, (100, 0), (110, 40)),
        (3, 3): seen(3, ["sh", "-c", "step"], 2, (0, 0), (25, 0), gone=True),
        (4, 4): seen(4, ["postgres: x"], 1, (50, 0), (80, 0)),
    }
    assert account(processes) == {"worker and its steps": (10 + 40 - 25 + 25) / TICKS, "postgres": 30 / TICKS}


def test_a_process_without_a_named_ancestor_is_other():
    processes = {(5, 5): seen(5, ["sleep", "9"], 1, (0, 0), (7, 0))}
    assert account(processes) == {"other": 7 / TICKS}


def test_a_child_that_burns_and_exits_in_the_window_is_counted_whole():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    with CpuAccount() as cpu:
        subprocess.run([sys.executable, "-c", burn], check=True)
    # The child (born in the window, reaped by this process) is in this process's group: at least
    # its 0.6 s; the machine's busy cores show it too.
    here = group_of(Path("/proc/self/cmdline").read_bytes().decode().split("\0")) or "other"
    assert cpu.between().get(here, 0) >= 0.55, cpu.between()
    assert cpu.busy_cores_between() > 0.2


def test_a_window_counts_only_what_was_spent_around_it():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8: pass"
    with CpuAccount(sample_seconds=0.05) as cpu:
        time.sleep(0.5)
        idle_until = time.time()
        subprocess.run([sys.executable, "-c", burn], check=True)
    here = group_of(Path("/proc/self/cmdline").read_bytes().decode().split("\0")) or "other"
    assert cpu.between(end=idle_until - 0.1).get(here, 0) < 0.1, "the burn is not before it started"
    assert cpu.between(start=idle_until).get(here, 0) >= 0.75
    assert cpu.span(end=idle_until - 0.1) < 0.6


def test_a_busy_process_time_after_its_last_sample_stays_in_its_own_group_not_its_reapers():
    # On kind: a worker stepping until it exits, reaped by its container's shim. Its last sample
    # showed 64 ticks of lifetime; the shim's children's time grew by its whole lifetime, 107.
    processes = {
        (10, 10): seen(10, ["/usr/local/bin/containerd-shim-runc-v2", "-id", "x"], 1, (5, 15), (6, 122)),
        (11, 11): seen(11, ["/opt/retex/bin/python", "/opt/retex/bin/retex-worker"], 10, (42, 2), (62, 2), gone=True),
    }
    assert account(processes) == {"worker and its steps": (20 + 43) / TICKS, "container runtime": 1 / TICKS}
