"""The README's quickstart, as written: its three commands make a kind cluster with the images built
here, install retex with Helm and run a Task to Succeeded.

It makes and deletes a kind cluster of its own, so it runs only when asked by `make
e2e-quickstart` (RETEX_QUICKSTART_CLUSTER names that cluster), never inside `make e2e-kind`,
whose cluster would be a second one beside it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CLUSTER = os.environ.get("RETEX_QUICKSTART_CLUSTER", "")

pytestmark = pytest.mark.slow


def quickstart_commands() -> list[str]:
    """The shell lines of the first ```sh block under the README's "## Quickstart" heading."""
    section = README.read_text().split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.S)
    assert block, "README.md's Quickstart has no ```sh block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_quickstart_is_three_commands_naming_files_that_exist():
    commands = quickstart_commands()
    assert len(commands) == 3, commands
    named = {word for line in commands for word in re.findall(r"(?:charts|e2e|examples)/[-\w./]+", line)}
    assert named, commands
    assert sorted(path for path in named if not (ROOT / path).exists()) == []


@pytest.mark.timeout(3600)
def test_the_quickstart_runs_a_task_to_succeeded_on_kind(tmp_path):
    if not CLUSTER:
        pytest.skip("makes a kind cluster of its own: make e2e-quickstart (RETEX_QUICKSTART_CLUSTER)")
    kubeconfig = tmp_path / "kubeconfig"
    env = os.environ | {"KUBECONFIG": str(kubeconfig), "RETEX_KIND_CLUSTER": CLUSTER} | {
        f"HELM_{kind}_HOME": str(tmp_path / "helm" / kind.lower()) for kind in ("CONFIG", "CACHE", "DATA")}
    kind = subprocess.run(["bash", "e2e/kind/kind-path.sh"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        for command in quickstart_commands():
            print(f"[quickstart] $ {command}", flush=True)
            ran = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, env=env)
            assert ran.returncode == 0, f"{command}: exit {ran.returncode}"
        shown = subprocess.run(
            ["kubectl", "get", "-n", "retex-examples", "tasks.retex.dev", "word-count-pipeline", "-o",
             "jsonpath={.status.phase} {.status.progress}"], env=env, capture_output=True, text=True, timeout=60)
        assert shown.stdout == "Succeeded 3/3", shown
        release = subprocess.run([str(ROOT / ".venv" / "bin" / "helm"), "status", "retex", "-n", "retex-system"],
                                 env=env, capture_output=True, text=True, timeout=60)
        assert "STATUS: deployed" in release.stdout, release
    finally:
        subprocess.run([kind, "delete", "cluster", "--name", CLUSTER], env=env, check=False)
