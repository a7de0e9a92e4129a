"""CPU time by process group over a window, from /proc: who spent the cores while a measure ran.

A sampling profiler cannot tell a thread blocked in a read from one running (py-spy counted 80 s
of "CPU" in 40 s on 2 cores); the kernel's own counters can. Five times a second a thread reads
each process's own time (utime + stime) and its reaped children's (cutime + cstime). A process
counts from the first sample (from nothing if it was born after it) to its last. A child reaped
meanwhile adds its whole lifetime to its parent's children's time: the part its samples showed is
taken back out, and the rest (what it spent after its last sample: up to a fifth of a second of a busy
worker's stepping) is counted in the child's group. A process too short to be seen (a step's
`true`) is counted in the one that reaped it, or with the seen ones reaped beside it.

Kind's nodes are containers on this host's kernel, so their pods' processes are in this /proc too.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SAMPLE_SECONDS = 0.2  # a sweep of /proc takes ~7 ms for ~150 processes: 3% of a core
TICKS = os.sysconf("SC_CLK_TCK")

# A process's group from its command line; one that matches none takes its parent's.
_BY_NAME = {"kube-apiserver": "kube-apiserver", "etcd": "etcd", "kube-controller-manager": "controllers",
            "kube-scheduler": "scheduler", "kubelet": "kubelet", "containerd": "container runtime",
            "containerd-shim-runc-v2": "container runtime", "runc": "container runtime",
            "dockerd": "container runtime", "docker-proxy": "container runtime"}
_BY_WORD = (("retex-operator", "operator"), ("retex-worker", "worker and its steps"),
            ("retex/worker/", "worker and its steps"), ("e2e.rig.agent", "node agent (rig)"),
            ("e2e.bench", "bench"), ("pytest", "bench"),
            # kind's nodes: our pod network's loop (e2e/kind/node-cni.sh: kubectl every 5 s on each node)
            ("node-cni.sh", "kind's node-cni loop"))


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
    """All CPUs' busy ticks from /proc/stat's first line: user, nice, system, irq and softirq (not
    idle, iowait, or steal: time the hypervisor gave elsewhere; guest time is inside user's)."""
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in proc_stat.splitlines()[0].split()[1:8])
    return user + nice + system + irq + softirq


@dataclass
class _Seen:
    pid: int
    argv: list[str]
    first: ProcStat
    last: ProcStat
    gone: bool = False
    last_seen: int = 0  # the index of the last snapshot that shows it


def account(seen: dict[tuple[int, int], _Seen]) -> dict[str, float]:
    """Seconds of CPU by group: each process's growth from its first sample to its last.

    A reaper's children's time grows by the whole lifetime of each child it reaps. For a seen
    child, what its last sample showed is counted with it already, so that is taken out of its
    reaper's: the nearest ancestor still sampled after the child was (a parent last seen no later
    than its child reaped it, if at all, after its own last sample, and so handed it on, inside its
    own lifetime, to its reaper; a worker killing its tether as it exits does that). The rest of
    the reaper's growth (what the reaped spent after their last samples, and children too short
    to be seen) goes to the reaped ones' group when they had one group (a worker stepping until it
    exits is still the worker), else stays with the reaper."""
    ordered = sorted(seen.values(), key=lambda s: s.first.start)
    latest = {s.pid: s for s in ordered}  # a pid used again: the newer process

    def group(s: _Seen) -> str:
        for _ in range(64):  # up the parents to one that is named; a loop would be a /proc oddity
            found = group_of(s.argv)
            if found is not None:
                return found
            if s.first.ppid not in latest:
                break
            s = latest[s.first.ppid]
        return "other"

    def reaper(child: _Seen) -> _Seen | None:
        parent = latest.get(child.last.ppid)
        for _ in range(64):
            if parent is None or not parent.gone or parent.last_seen > child.last_seen:
                return parent
            parent = latest.get(parent.last.ppid)
        return None

    reaped: dict[int, int] = {}  # by the reaper's id(): the lifetimes its seen children had when last seen
    reaped_groups: dict[int, set[str]] = {}
    for s in ordered:
        if s.gone and (by := reaper(s)) is not None:
            reaped[id(by)] = reaped.get(id(by), 0) + s.last.own_ticks + s.last.children_ticks
            reaped_groups.setdefault(id(by), set()).add(group(s))
    ticks_by_group: dict[str, int] = {}

    def add(name: str, ticks: int) -> None:
        ticks_by_group[name] = ticks_by_group.get(name, 0) + ticks

    for s in ordered:
        own = s.last.own_ticks - s.first.own_ticks
        children = s.last.children_ticks - s.first.children_ticks
        if id(s) in reaped:
            children = max(children - reaped[id(s)], 0)
            if len(reaped_groups[id(s)]) == 1:
                add(next(iter(reaped_groups[id(s)])), children)
                children = 0
        add(group(s), own + children)
    seconds = {name: ticks / TICKS for name, ticks in ticks_by_group.items() if ticks}
    return dict(sorted(seconds.items(), key=lambda item: -item[1]))


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.time(): comparable with the ledger's timestamps (one host clock)
    busy_ticks: int
    processes: dict[tuple[int, int], ProcStat]  # by (pid, starttime)


def seen_between(snapshots: list[Snapshot], argv: dict[tuple[int, int], list[str]]) -> dict[tuple[int, int], _Seen]:
    """Every process of these snapshots, from the first (from nothing if born after it) to the last
    that shows it, gone if the last snapshot does not."""
    first, final = snapshots[0].processes, snapshots[-1].processes
    seen: dict[tuple[int, int], _Seen] = {}
    for index, snapshot in enumerate(snapshots):
        for key, stat in snapshot.processes.items():
            if key not in seen:
                start = first.get(key, ProcStat(stat.ppid, 0, 0, stat.start))
                seen[key] = _Seen(key[0], argv.get(key, []), start, stat, gone=key not in final)
            seen[key].last, seen[key].last_seen = stat, index
    return seen


class CpuAccount:
    """`with CpuAccount() as cpu: ...`, then `cpu.between(start, end)` (seconds by group, or the
    whole window without bounds) and `cpu.busy_cores_between(...)` (the whole machine's)."""

    def __init__(self, proc: Path = Path("/proc"), sample_seconds: float = SAMPLE_SECONDS):
        self.proc, self.sample_seconds = proc, sample_seconds
        self.snapshots: list[Snapshot] = []
        self._argv: dict[tuple[int, int], list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def _sample(self) -> None:
        processes = {}
        for entry in os.scandir(self.proc):
            if not entry.name.isdigit():
                continue
            try:
                stat = parse_stat((self.proc / entry.name / "stat").read_text())
                key = (int(entry.name), stat.start)
                if key not in self._argv:
                    argv = (self.proc / entry.name / "cmdline").read_bytes().split(b"\0")
                    self._argv[key] = [a.decode(errors="replace") for a in argv if a]
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue  # gone between listing and reading
            processes[key] = stat
        self.snapshots.append(Snapshot(time.time(), busy_ticks((self.proc / "stat").read_text()), processes))

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.sample_seconds):
            self._sample()

    def _within(self, start: float | None, end: float | None) -> list[Snapshot]:
        """The snapshots from the last one at or before `start` to the first at or after `end`."""
        times = [snapshot.at for snapshot in self.snapshots]
        first = 0 if start is None else max((i for i, at in enumerate(times) if at <= start), default=0)
        last = len(times) - 1 if end is None else min((i for i, at in enumerate(times) if at >= end), default=len(times) - 1)
        return self.snapshots[first:max(last, first + 1) + 1]

    def between(self, start: float | None = None, end: float | None = None) -> dict[str, float]:
        """CPU seconds by group from about `start` to about `end` (the snapshots around them)."""
        return account(seen_between(self._within(start, end), self._argv))

    def cores_between(self, start: float | None = None, end: float | None = None) -> dict[str, float]:
        """Each group's CPU as cores kept busy from about `start` to about `end`."""
        span = max(self.span(start, end), 1e-9)
        return {group: seconds / span for group, seconds in self.between(start, end).items()}

    def span(self, start: float | None = None, end: float | None = None) -> float:
        """The seconds `between` covers for these bounds."""
        within = self._within(start, end)
        return within[-1].at - within[0].at

    def busy_cores_between(self, start: float | None = None, end: float | None = None) -> float:
        within = self._within(start, end)
        return (within[-1].busy_ticks - within[0].busy_ticks) / TICKS / max(within[-1].at - within[0].at, 1e-9)

    def __enter__(self) -> CpuAccount:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
