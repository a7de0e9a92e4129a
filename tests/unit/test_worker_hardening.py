"""A step running as the worker's user cannot read the worker's environment (the ledger DSN)."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SOURCE_ROOT = str(Path(__file__).resolve().parents[2] / "operator")
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by an unprivileged user, unlike a private pyenv
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(SYSTEM_PYTHON),
    reason="needs root to run two processes as one unprivileged user")

HOLDER = ("import sys, time\n"
          "from retex.worker.hardening import refuse_same_user_inspection\n"
          "if sys.argv[1] == 'harden': refuse_same_user_inspection()\n"
          "print('ready', flush=True); time.sleep(30)\n")


def environ_seen_by_same_user(harden: bool) -> str:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": SOURCE_ROOT, "RETEX_DATABASE_URL": "password=hunter2"}
    holder = subprocess.Popen([*AS_NOBODY, SYSTEM_PYTHON, "-c", HOLDER, "harden" if harden else "plain"],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        time.sleep(0.1)
        # setpriv execs python in place, so the holder's pid is the python process.
        return subprocess.run([*AS_NOBODY, "cat", f"/proc/{holder.pid}/environ"],
                              capture_output=True, text=True).stdout
    finally:
        holder.kill()
        holder.wait()


def test_without_hardening_the_same_user_reads_the_dsn():
    assert "hunter2" in environ_seen_by_same_user(harden=False)  # the threat is real


def test_a_hardened_worker_environment_is_unreadable_to_the_same_user():
    assert environ_seen_by_same_user(harden=True) == ""
