"""e2e/kind/run.sh hands pytest its whole default list as one command line: the list spans lines,
and `eval` took each newline for the end of a command (`make e2e-kind` ran the first line's files,
then tried to execute `tests/cluster/test_chaos.py`)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "e2e" / "kind" / "run.sh"


def pytest_arguments(env_tests: str | None = None) -> list[str]:
    """The arguments run.sh's pytest line gives pytest: its test list's lines (from the default
    list to `TESTS=`) and its pytest line alone, run with `$PY` a stand-in printing each argument."""
    lines = RUN_SH.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("DEFAULT_TESTS="))
    end = next(i for i, line in enumerate(lines) if line.startswith("TESTS="))
    (pytest_line,) = [line for line in lines if line.startswith("eval ") and "-m pytest" in line]
    script = "\n".join([*lines[start:end + 1], "print_arguments() { printf '%s\\n' \"$@\"; }; PY=print_arguments", pytest_line.replace('"$PY" -m pytest', '"$PY"')])
    env = {"PATH": "/usr/bin:/bin"} | ({"RETEX_KIND_TESTS": env_tests} if env_tests is not None else {})
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_default_list_reaches_pytest_whole_as_existing_files():
    files = pytest_arguments()
    assert len(files) > 10 and "tests/cluster/test_cli_as_user.py" in files, files
    assert [f for f in files if not (ROOT / f).is_file()] == []


def test_the_default_list_is_every_scenario_file_but_those_proving_the_rig_itself():
    """kind runs the same scenario suite as the rig: a new file in tests/cluster joins it unless it
    proves the local rig (test_rig_*), `make dev` on the rig (test_dev.py), makes a kind cluster
    of its own (test_quickstart.py: `make e2e-quickstart`), or lowers a node's CPU priority, which
    only the rig does (test_noisy_neighbours.py)."""
    on_the_rig_only = ("test_dev.py", "test_quickstart.py", "test_noisy_neighbours.py")
    scenarios = {f"tests/cluster/{path.name}" for path in (ROOT / "tests" / "cluster").glob("test_*.py")
                 if not path.name.startswith("test_rig_") and path.name not in on_the_rig_only}
    files = pytest_arguments()
    assert set(files) == scenarios
    assert files[-1] == "tests/cluster/test_chart_on_rig.py", "the chart's test swaps the deployed manifests: last"


def test_a_chosen_list_keeps_its_quotes():
    assert pytest_arguments('tests/cluster/test_crash_matrix.py -k "R5_ or R7_"') == [
        "tests/cluster/test_crash_matrix.py", "-k", "R5_ or R7_"]


def test_without_a_docker_engine_it_fails_saying_nothing_ran(tmp_path):
    # Green for nothing would read as "passed on kind".
    (tmp_path / "docker").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "docker").chmod(0o755)
    result = subprocess.run(["bash", str(RUN_SH)], capture_output=True, text=True, cwd=ROOT,
                            env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, timeout=60)
    assert result.returncode != 0
    assert "nothing was run" in result.stdout
