"""What can be checked of the images (images/Dockerfile) without building them: hadolint passes,
the runtime user is the one the operator's Jobs run as, and the lock pins every runtime dependency
of pyproject.toml. tests/images/ runs the built images."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from retex.kube.objects import WorkerDefaults

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "images" / "Dockerfile"
LOCK = ROOT / "images" / "requirements.lock"
EXTENDED_WORKER = ROOT / "examples" / "custom-worker" / "Dockerfile"
KIND_NODE_BASE = ROOT / "e2e" / "kind" / "Dockerfile.base"
KIND_POSTGRES_DEV = ROOT / "e2e" / "kind" / "postgres-dev" / "Dockerfile"


def _hadolint() -> str:
    found = Path(sys.executable).parent / "hadolint"
    if found.exists():
        return str(found)
    on_path = shutil.which("hadolint")
    if on_path is None:
        pytest.fail("hadolint is not installed: `make lint-docker` installs it into .venv")
    return on_path


def _stages(text: str) -> dict[str, str]:
    """Stage name → its instructions."""
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, EXTENDED_WORKER, KIND_NODE_BASE, KIND_POSTGRES_DEV], ids=lambda p: str(p.relative_to(ROOT)))
def test_dockerfiles_pass_hadolint(dockerfile):
    result = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_operator_and_worker_targets_run_as_the_jobs_non_root_user():
    stages = _stages(DOCKERFILE.read_text())
    assert {"build", "runtime", "operator", "worker"} <= stages.keys()
    uid = WorkerDefaults(image="", service_account="", ledger_url="").run_as_user
    assert f"USER {uid}:{uid}" in stages["runtime"]
    assert 'ENTRYPOINT ["retex-worker"]' in stages["worker"]
    assert 'ENTRYPOINT ["retex-operator"]' in stages["operator"]


def test_runtime_stages_install_nothing_and_keep_no_pip():
    stages = _stages(DOCKERFILE.read_text())
    for name in ("runtime", "operator", "worker"):
        assert not re.search(r"apt-get|apk |pip install|gcc|build-essential", stages[name]), name
    assert "pip uninstall --yes pip" in stages["runtime"]
    assert "COPY --from=build /opt/retex /opt/retex" in stages["runtime"]


def test_lock_pins_every_runtime_dependency_with_hashes():
    lock = LOCK.read_text()
    pinned = {canonicalize_name(m[0]): m[1] for m in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", lock, re.MULTILINE)}
    assert "--hash=sha256:" in lock
    assert all(line.startswith(("#", " ", "--hash")) or "==" in line or not line.strip()
               for line in lock.splitlines()), "only pinned requirements in the lock"
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dependency in map(Requirement, dependencies):
        name = canonicalize_name(dependency.name)
        assert name in pinned, f"{name} missing from images/requirements.lock: run `make images-lock`"
        assert dependency.specifier.contains(pinned[name]), (
            f"{name}=={pinned[name]} does not satisfy {dependency}: run `make images-lock`")
        for extra in dependency.extras:  # psycopg[binary] → psycopg-binary
            assert canonicalize_name(f"{name}-{extra}") in pinned


def test_build_context_sends_what_the_dockerfile_copies():
    ignore = (ROOT / "images" / "Dockerfile.dockerignore").read_text()
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE.read_text(), re.MULTILINE)
    for sources in copied:
        for source in sources.split():
            assert f"!{source}" in ignore, f"{source} is copied but excluded from the build context"
