"""The built images, run by a real Docker engine (`make images` builds them; marker `images`).

Each container runs as the operator's Jobs run the worker: uid 65532, a read-only root filesystem,
a writable /tmp only. A python step and an exec step run inside the worker image through the
worker's own step runners, without a cluster or a ledger."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap

import pytest

from retex.kube.objects import WorkerDefaults

pytestmark = pytest.mark.images

TAG = os.environ.get("RETEX_IMAGE_TAG", "dev")
WORKER = f"retex-worker:{TAG}"
OPERATOR = f"retex-operator:{TAG}"
JOB_UID = WorkerDefaults(image="", service_account="", ledger_url="").run_as_user


def docker(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module", autouse=True)
def built_images():
    if shutil.which("docker") is None or docker("info").returncode != 0:
        pytest.fail("no Docker engine answers `docker info`: images/docker-engine.sh starts one")
    for image in (WORKER, OPERATOR):
        if docker("image", "inspect", image).returncode != 0:
            pytest.fail(f"{image} is not built: run `make images`")


def run_locked_down(image: str, *args: str, entrypoint: str | None = None, volumes: tuple[str, ...] = (),
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """As a Job's pod runs it: read-only root, a tmpfs /tmp, no network, the image's own user."""
    options = ["--rm", "--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev", "--network", "none"]
    if entrypoint is not None:
        options += ["--entrypoint", entrypoint]
    for volume in volumes:
        options += ["-v", volume]
    for name, value in (env or {}).items():
        options += ["-e", f"{name}={value}"]
    return docker("run", *options, image, *args)


def test_operator_entrypoint_starts():
    result = run_locked_down(OPERATOR, "--help")
    assert result.returncode == 0, result.stderr
    assert "retex operator" in result.stdout and "--namespace" in result.stdout


def test_worker_entrypoint_starts_and_refuses_a_missing_environment():
    # Outside a Job the worker has no task to run: it says what is missing and exits 2
    # (BAD_ENVIRONMENT), which proves the entrypoint and its imports load in the image.
    result = run_locked_down(WORKER)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("retex-worker: "), result.stderr


def test_worker_runs_as_the_jobs_uid_with_a_read_only_root():
    probe = textwrap.dedent("""
        import json, os
        def writable(path):
            try:
                open(path, "w").close()
                return True
            except OSError:
                return False
        print(json.dumps({"uid": os.getuid(), "gid": os.getgid(),
                          "root_writable": writable("/opt/retex/probe"), "tmp_writable": writable("/tmp/probe")}))
    """)
    result = run_locked_down(WORKER, "-c", probe, entrypoint="python")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"uid": JOB_UID, "gid": JOB_UID, "root_writable": False,
                                         "tmp_writable": True}


def test_worker_image_has_no_pip_and_no_compiler():
    probe = ("import importlib.util, shutil; "
             "print(importlib.util.find_spec('pip'), [c for c in ('cc', 'gcc', 'pip', 'pip3') if shutil.which(c)])")
    result = run_locked_down(WORKER, "-c", probe, entrypoint="python")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None []"


# The worker's own step runners, called as retex.worker.steps.by_kind does for one attempt's step.
RUN_STEP = textwrap.dedent("""
    import dataclasses, json, sys
    from retex.api.models import Step
    from retex.worker.supervision import StepCall, Supervision, step_environment
    from retex.worker.drain import Drain
    from retex.worker.steps.by_kind import run_step
    step = Step.model_validate(json.loads(sys.argv[1]))
    call = StepCall(task_uid="uid-1", step=step.name, idempotency_key="uid-1:charge:abcd1234", attempt=1,
                    payload={"amount": 42}, results={})
    outcome = run_step(step, call, Supervision(drain=Drain(30.0), env=step_environment(), kill_grace_seconds=0.5))
    print(json.dumps({"outcome": type(outcome).__name__, **dataclasses.asdict(outcome)}))
""")


def test_a_python_step_runs_in_the_worker_image(tmp_path):
    # Step code as examples/custom-worker adds it: a module on PYTHONPATH, read-only to the worker.
    steps = tmp_path / "steps"
    steps.mkdir()
    (steps / "shop.py").write_text(textwrap.dedent("""
        import os
        def charge(context, currency):
            return {"uid": os.getuid(), "amount": context.payload["amount"], "currency": currency,
                    "key": context.idempotency_key}
    """))
    steps.chmod(0o755)
    (steps / "shop.py").chmod(0o644)
    step = {"name": "charge", "python": {"callable": "shop:charge", "args": {"currency": "EUR"}}}
    result = run_locked_down(WORKER, "-c", RUN_STEP, json.dumps(step), entrypoint="python",
                             volumes=(f"{steps}:/opt/steps:ro",), env={"PYTHONPATH": "/opt/steps"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "outcome": "Succeeded",
        "result": {"uid": JOB_UID, "amount": 42, "currency": "EUR", "key": "uid-1:charge:abcd1234"}}


def test_an_exec_step_runs_in_the_worker_image():
    script = "import os; print(os.getuid(), os.environ['RETEX_IDEMPOTENCY_KEY'])"
    step = {"name": "charge", "exec": {"command": ["python", "-c", script]}}
    result = run_locked_down(WORKER, "-c", RUN_STEP, json.dumps(step), entrypoint="python")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "outcome": "Succeeded",
        "result": {"exitCode": 0, "stdout": f"{JOB_UID} uid-1:charge:abcd1234\n", "stderr": ""}}
