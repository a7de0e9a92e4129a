"""The bench's CPU accounting from /proc (e2e/cpu.py): the counters read right, a process counted
once whether it is still running, was born in the window, or was reaped in it."""

import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cpu import TICKS, CpuAccount, ProcStat, Snapshot, _Seen, account, busy_ticks, group_of, parse_stat


def stat_line(pid, comm, ppid, utime, stime, cutime, cstime, start):
    # fields 1..22 of /proc/<pid>/stat; the ones not read are zeros
    rest = ["S", ppid, 0, 0, 0, 0, 0, 0, 0, 0, 0, utime, stime, cutime, cstime, 0, 0, 0, 0, start, 0, 0]
    return f"{pid} ({comm}) " + " ".join(str(v) for v in rest)


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields():
    parsed = parse_stat(stat_line(7, "a (b) c", 3, 11, 12, 13, 14, 99))
    assert parsed == ProcStat(ppid=3, own_ticks=23, children_ticks=27, start=99)


def test_busy_ticks_leave_out_idle_iowait_and_steal():
    # user nice system idle iowait irq softirq steal guest guest_nice
    assert busy_ticks("cpu  1 2 3 1000 2000 4 5 600 1 0\ncpu0 1 1 1 1 1 1 1 1\n") == 1 + 2 + 3 + 4 + 5


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


def snapshot(at, processes):
    """A snapshot at `at` of {pid: (ppid, own ticks, children's ticks)}, each pid started at its pid."""
    return Snapshot(at, 0, {(pid, pid): ProcStat(ppid, own, children, pid) for pid, (ppid, own, children) in processes.items()})


def window_account(snapshots, argv):
    cpu = CpuAccount()
    cpu.snapshots = snapshots
    cpu._argv = {(pid, pid): line for pid, line in argv.items()}
    return cpu


def test_a_window_counts_only_what_was_spent_from_the_snapshot_before_it_to_the_one_after():
    worker = {2: ["retex-worker"]}
    cpu = window_account([snapshot(10.0, {2: (1, 100, 0)}), snapshot(10.2, {2: (1, 130, 0)}),
                          snapshot(10.4, {2: (1, 150, 0)}), snapshot(10.6, {2: (1, 190, 0)})], worker)
    assert cpu.between(10.25, 10.35) == {"worker and its steps": 20 / TICKS}  # 10.2 to 10.4
    assert cpu.span(10.25, 10.35) == pytest.approx(0.2)
    assert cpu.between(10.2, 10.4) == {"worker and its steps": 20 / TICKS}  # on a snapshot: that one
    assert cpu.between() == {"worker and its steps": 90 / TICKS}
    assert cpu.between(end=10.1) == {"worker and its steps": 30 / TICKS}  # from the first


def test_a_busy_process_time_after_its_last_sample_stays_in_its_own_group_not_its_reapers():
    # On kind: a worker stepping until it exits, reaped by its container's shim. Its last sample
    # showed 64 ticks of lifetime; the shim's children's time grew by its whole lifetime, 107.
    processes = {
        (10, 10): seen(10, ["/usr/local/bin/containerd-shim-runc-v2", "-id", "x"], 1, (5, 15), (6, 122)),
        (11, 11): seen(11, ["/opt/retex/bin/python", "/opt/retex/bin/retex-worker"], 10, (42, 2), (62, 2), gone=True),
    }
    assert account(processes) == {"worker and its steps": (20 + 43) / TICKS, "container runtime": 1 / TICKS}


def test_a_tether_killed_with_its_worker_is_taken_out_of_the_shims_time_not_counted_twice():
    # The worker (pid 1 of its container) exits; the kernel kills its tether and the dying worker
    # reaps it after both were last seen; the shim reaps the worker, whose lifetime now holds the
    # tether's. Last seen: the worker at 152 ticks of its own, the tether at 61.
    shim, worker, tether = ["/usr/local/bin/containerd-shim-runc-v2"], ["retex-worker"], ["/x/retex/worker/tether.py"]
    cpu = window_account([
        snapshot(1.0, {10: (1, 5, 0), 11: (10, 100, 0), 12: (11, 40, 0)}),
        snapshot(1.2, {10: (1, 5, 0), 11: (10, 152, 0), 12: (11, 61, 0)}),
        snapshot(1.4, {10: (1, 5, 152 + 61 + 2)}),  # 2 ticks of their ends after the last samples
    ], {10: shim, 11: worker, 12: tether})
    assert cpu.between() == {"worker and its steps": (52 + 21 + 2) / TICKS}


def test_a_reaper_last_seen_after_its_child_keeps_the_reap_in_its_own_sampled_time():
    # The tether ends first (the worker reaps it while still sampled), then the worker.
    shim, worker, tether = ["/usr/local/bin/containerd-shim-runc-v2"], ["retex-worker"], ["/x/retex/worker/tether.py"]
    cpu = window_account([
        snapshot(1.0, {10: (1, 5, 0), 11: (10, 100, 0), 12: (11, 40, 0)}),
        snapshot(1.2, {10: (1, 5, 0), 11: (10, 120, 0), 12: (11, 50, 0)}),
        snapshot(1.4, {10: (1, 5, 0), 11: (10, 130, 51)}),  # the tether's 50, and 1 after its last sample
        snapshot(1.6, {10: (1, 6, 130 + 51)}),
    ], {10: shim, 11: worker, 12: tether})
    assert cpu.between() == {"worker and its steps": (30 + 10 + 1) / TICKS, "container runtime": 1 / TICKS}
