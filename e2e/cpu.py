"""CPU time by process group over a window, from /proc: who spent the cores while a measure ran.

A sampling profiler cannot tell a thread blocked in a read from one running (py-spy counted 80 s
of "CPU" in 40 s on 2 cores); the kernel's own counters can. Every half second a thread reads
each process's own time (utime + stime) and its reaped children's (cutime + cstime). A process
counts from the first sample (from nothing if it was born after it) to its last. A child reaped
meanwhile adds its whole lifetime to its parent's children's time, so that is taken back out for
every child seen and gone; a process too short to be seen (a step's `true`) stays counted in the
one that reaped it, and so does the time a seen one spent between its last sample and its exit.

Kind's nodes are containers on this host's kernel, so their pods' processes are in this /proc too.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SAMPLE_SECONDS = 0.5
TICKS = os.sysconf("SC_CLK_TCK")

# A process's group from its command line; one that matches none takes its parent's.
_BY_NAME = {"kube-apiserver": "kube-apiserver", "etcd": "etcd", "kube-controller-manager": "controllers",
            "kube-scheduler": "scheduler", "kubelet": "kubelet", "containerd": "container runtime",
            "containerd-shim-runc-v2": "container runtime", "runc": "container runtime",
            "dockerd": "container runtime", "docker-proxy": "container runtime"}
_BY_WORD = (("retex-operator", "operator"), ("retex-worker", "worker and its steps"),
            ("retex/worker/", "worker and its steps"), ("e2e.rig.agent", "node agent (rig)"),
            ("e2e.bench", "bench"), ("pytest", "bench"))


def group_of(argv: list[str]) -> str | None:
    """The group a command line belongs to, or None to take its parent's."""
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name.startswith("postgres"):  # backends rename themselves "postgres: user db ..."
        return "postgres"
    if name in _BY_NAME:
        return _BY_NAME[name]
    line = " ".join(argv)
    return next((group for word, group in _BY_WORD if word in line), None)


@dataclass(frozen=True)
class ProcStat:
    ppid: int
    own_ticks: int  # utime + stime
    children_ticks: int  # cutime + cstime: reaped children's whole lifetimes
    start: int  # starttime: a pid used again is another process


def parse_stat(text: str) -> ProcStat:
    """/proc/<pid>/stat; the command name (field 2) may hold spaces and parentheses."""
    fields = text[text.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return ProcStat(ppid=int(fields[1]), own_ticks=int(fields[11]) + int(fields[12]),
                    children_ticks=int(fields[13]) + int(fields[14]), start=int(fields[19]))


def busy_ticks(proc_stat: str) -> int:
    """All CPUs' non-idle ticks from /proc/stat's first line (idle and iowait are not busy)."""
    values = [int(v) for v in proc_stat.splitlines()[0].split()[1:9]]
    return sum(values) - values[3] - values[4]


@dataclass
class _Seen:
    pid: int
    argv: list[str]
    first: ProcStat
    last: ProcStat
    gone: bool = False


def account(seen: dict[tuple[int, int], _Seen]) -> dict[str, float]:
    """Seconds of CPU by group: each process's growth from its first sample to its last, less the
    lifetimes of its children that were seen and are gone (the reap folded them into its children's
    time, and they are counted on their own)."""
    latest = {s.pid: s for s in sorted(seen.values(), key=lambda s: s.first.start)}

    def group(s: _Seen) -> str:
        for _ in range(64):  # up the parents to one that is named; a loop would be a /proc oddity
            found = group_of(s.argv)
            if found is not None:
                return found
            if s.first.ppid not in latest:
                break
            s = latest[s.first.ppid]
        return "other"

    reaped: dict[int, int] = {}  # by the reaper's pid: its children's time that is theirs
    for s in seen.values():
        if s.gone:
            reaped[s.last.ppid] = reaped.get(s.last.ppid, 0) + s.last.own_ticks + s.last.children_ticks
    seconds: dict[str, float] = {}
    for s in seen.values():
        ticks = s.last.own_ticks - s.first.own_ticks + s.last.children_ticks - s.first.children_ticks
        if latest[s.pid] is s:
            ticks -= reaped.get(s.pid, 0)
        name = group(s)
        seconds[name] = seconds.get(name, 0.0) + max(ticks, 0) / TICKS
    return dict(sorted(seconds.items(), key=lambda item: -item[1]))


class CpuAccount:
    """`with CpuAccount() as cpu: ...`, then `cpu.seconds` by group, `cpu.busy_cores` (the whole
    machine's) and `cpu.elapsed`."""

    def cores(self) -> dict[str, float]:
        """Each group's CPU as cores kept busy over the window."""
        return {group: seconds / max(self.elapsed, 1e-9) for group, seconds in self.seconds.items()}

    def __init__(self, proc: Path = Path("/proc")):
        self.proc = proc
        self.seconds: dict[str, float] = {}
        self.busy_cores = self.elapsed = 0.0
        self._seen: dict[tuple[int, int], _Seen] = {}
        self._sampled = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def _sample(self) -> None:
        alive = set()
        for entry in os.scandir(self.proc):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                stat = parse_stat((self.proc / entry.name / "stat").read_text())
                key = (pid, stat.start)
                if key not in self._seen:
                    argv = (self.proc / entry.name / "cmdline").read_bytes().split(b"\0")
                    # Born in the window (not in the first sample): all its time is in it.
                    first = ProcStat(stat.ppid, 0, 0, stat.start) if self._sampled else stat
                    self._seen[key] = _Seen(pid, [a.decode(errors="replace") for a in argv if a], first, stat)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue  # gone between listing and reading
            self._seen[key].last = stat
            alive.add(key)
        for key, seen in self._seen.items():
            seen.gone = key not in alive
        self._sampled = True

    def _busy(self) -> tuple[int, float]:
        return busy_ticks((self.proc / "stat").read_text()), time.monotonic()

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._sample()

    def __enter__(self) -> CpuAccount:
        self._sample()
        self._started = self._busy()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        ticks, at = self._busy()
        self.elapsed = at - self._started[1]
        self.busy_cores = (ticks - self._started[0]) / TICKS / max(self.elapsed, 1e-9)
        self.seconds = account(self._seen)
