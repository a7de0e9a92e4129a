"""`make dev` as a newcomer uses it: the commands it prints work as printed (the CLI plugin on
PATH, the context's namespace followed), RETEX_* settings of the shell reach the operator, and
`make dev-operator` restarts only the operator with new ones. Its own rig and Postgres (as
`make dev` starts them), in a state directory of the test's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from e2e.rig import procs

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]


def dev(command: str, state: Path, **settings: str) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("RETEX_")}
    return subprocess.run([sys.executable, "-m", "e2e.dev", command, "--state-dir", str(state)], cwd=REPO,
                          env={**environment, **settings}, capture_output=True, text=True, timeout=400)


def printed(output: str, starts: str) -> str:
    [line] = [line.strip() for line in output.splitlines() if line.strip().startswith(starts)]
    return line.split("  #")[0].strip()


def operator_environment(state: Path) -> dict[str, str]:
    pid = procs.recorded_pid(state / "pids" / "operator")
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in raw if b"=" in entry)


def test_make_dev_prints_commands_that_work_and_passes_retex_settings_to_the_operator():
    # Not pytest's tmp_path: Postgres runs as nobody and must traverse the directory (0755).
    state = Path(tempfile.mkdtemp(prefix="retex-dev-test-"))
    try:
        up = dev("up", state, RETEX_RESYNC_SECONDS="7")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert operator_environment(state)["RETEX_RESYNC_SECONDS"] == "7"  # the shell's, not the rig's 5

        # The tour as printed, in a clean shell: KUBECONFIG, PATH, the context's namespace, the CLI.
        tour = "\n".join(["set -e", printed(up.stdout, "export KUBECONFIG="), printed(up.stdout, "export PATH="),
                          printed(up.stdout, "kubectl config set-context"),
                          printed(up.stdout, "kubectl retex history")])
        clean = {"HOME": os.environ.get("HOME", "/root"), "PATH": os.environ["PATH"].replace(str(Path(sys.executable).parent) + ":", "")}
        shell = subprocess.run(["bash", "-c", tour], env=clean, capture_output=True, text=True, timeout=60)
        assert shell.returncode == 0, f"{tour}\n{shell.stdout}\n{shell.stderr}"
        assert "order-1042" in shell.stdout and "retex-examples" in shell.stdout, shell.stdout

        first = procs.recorded_pid(state / "pids" / "operator")
        again = dev("operator", state, RETEX_MAX_RUNNING="2")
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "RETEX_MAX_RUNNING=2" in again.stdout, again.stdout
        assert procs.recorded_pid(state / "pids" / "operator") not in (None, first)
        assert operator_environment(state)["RETEX_MAX_RUNNING"] == "2"
        kubeconfig = json.loads((state / "dev.json").read_text())["kubeconfig"]
        waited = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "wait", "-n", "retex-examples",
                                 "--for=condition=Succeeded", "task/order-1042", "--timeout=120s"],
                                capture_output=True, text=True)
        assert waited.returncode == 0, waited.stderr + (state / "operator.log").read_text()[-3000:]
    finally:
        down = dev("down", state)
        assert down.returncode == 0, down.stdout + down.stderr
        shutil.rmtree(state, ignore_errors=True)
