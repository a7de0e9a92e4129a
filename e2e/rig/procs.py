"""Process records: every process the rig starts leads its own process group and is written down
as "<pid> <start time>" in a file, so teardown (and the cleanup of a crashed run) signals exactly
the groups it started — never by name, and never a recycled PID (the start time must match).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (state) on: [0] state, [1] parent, [2] process group,
    [19] start time. The command name (field 2) may contain spaces, so split after its ')'.
    OSError once the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None if it is gone."""
    try:
        return stat_fields(pid)[19]
    except OSError:
        return None


def is_zombie(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] == "Z"
    except OSError:
        return True


def record(path: Path, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{pid} {start_time(pid)}\n")
    tmp.replace(path)


def recorded_pid(path: Path) -> int | None:
    """The PID in a record if that very process still runs (same start time), else None."""
    try:
        pid_text, started = path.read_text().split()
    except (OSError, ValueError):
        return None
    pid = int(pid_text)
    if start_time(pid) != started or is_zombie(pid):
        return None
    return pid


def spawn(argv: list[str], record_path: Path, log_path: Path, **kwargs) -> subprocess.Popen:
    """Start `argv` as the leader of a new session/process group, output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, **kwargs,
        )
    record(record_path, proc.pid)
    return proc


def signal_group(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until `pid` has exited (reaping it if it is our child); True if it did in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:  # not our child: watch /proc instead
            if is_zombie(pid):
                return True
        time.sleep(0.05)
    return False


def stop(record_path: Path, grace: float = 10.0, sig: int = signal.SIGTERM) -> bool:
    """Signal the recorded process group (SIGTERM, then SIGKILL after `grace`); drop the record.

    Returns True if a live process was found.
    """
    pid = recorded_pid(record_path)
    if pid is not None:
        signal_group(pid, sig)
        if sig != signal.SIGKILL and not wait_gone(pid, grace):
            signal_group(pid, signal.SIGKILL)
        wait_gone(pid, 5.0)
        signal_group(pid, signal.SIGKILL)  # stragglers left in the group by the leader
    record_path.unlink(missing_ok=True)
    return pid is not None
