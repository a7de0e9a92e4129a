"""The Task CRD on a real API server (the local rig): what it accepts, what it refuses and with
which message, what kubectl shows, and that a status in the model's shape survives a round trip."""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e.system import discard_namespace, install_policies, prepare_namespace, wait_established
from retex.api import (
    Condition,
    ConditionType,
    LeaseStatus,
    StepStatus,
    TaskSpec,
    TaskStatus,
    crd,
    models,
    set_condition,
)
from retex.machine import StepState, TaskPhase
from tests.unit.test_api_models import docs_task_examples
from tests.unit.test_api_refusals import REFUSALS, spec_with, step

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "tasks.retex.dev.yaml"
# Unique per session: on an external cluster (RETEX_KUBECONFIG) an earlier run's namespace may linger.
NAMESPACE = f"retex-task-api-{uuid.uuid4().hex[:8]}"
T0 = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)


def as_json(value: Any) -> str:
    # kubectl reads JSON with a YAML parser, which refuses escaped surrogate pairs such as
    # "\ud800\udc00": characters outside the BMP must be written as they are.
    return json.dumps(value, ensure_ascii=False)


class Tasks:
    """kubectl on Tasks in the test namespace."""

    def __init__(self, rig):
        self.rig = rig

    def kubectl(self, *args: str, input: str | None = None, check: bool = True):
        return self.rig.kubectl("-n", NAMESPACE, *args, input=input, check=check)

    def apply(self, name: str, spec: dict[str, Any], check: bool = False, verb: str = "apply"):
        manifest = {"apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": name}, "spec": spec}
        return self.kubectl(verb, "-f", "-", input=as_json(manifest), check=check)

    def get(self, name: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", "task", name, "-o", "json").stdout)

    def patch_spec(self, name: str, patch: Any, type: str = "merge"):
        return self.kubectl("patch", "task", name, f"--type={type}", "-p", as_json(patch), check=False)

    def write_status(self, name: str, status: TaskStatus, check: bool = True):
        patch = as_json({"status": status.to_json()})
        return self.kubectl("patch", "task", name, "--subresource=status", "--type=merge", "-p", patch, check=check)


@pytest.fixture(scope="module")
def tasks(rig) -> Tasks:
    rig.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    wait_established(rig.kubectl, crd.CRD_NAME)
    # The OpenAPI document (kubectl explain, field validation) is published a moment after Established.
    deadline = time.monotonic() + 30
    while rig.kubectl("explain", "task.spec.steps", check=False).returncode != 0:
        assert time.monotonic() < deadline, "the Task schema never appeared in the OpenAPI document"
        time.sleep(0.5)
    install_policies(rig.kubectl)  # the shipped admission policies judge these Tasks too
    prepare_namespace(rig.kubectl, NAMESPACE)  # with a TaskPolicy allowing any image, ServiceAccount, placement
    yield Tasks(rig)
    discard_namespace(rig.kubectl, NAMESPACE)


def refusal_lines(stderr: str, name: str) -> set[str]:
    """The error lines of `The Task "<name>" is invalid: ...`, one or a `* `-bulleted list."""
    prefix = f'The Task "{name}" is invalid: '
    assert stderr.startswith(prefix), stderr
    return {line.strip().removeprefix("* ") for line in stderr[len(prefix) :].splitlines() if line.strip()}


def test_crd_is_established_and_structural(tasks):
    crd_object = json.loads(tasks.rig.kubectl("get", "crd", crd.CRD_NAME, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd_object["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema", "False") == "False"


def test_minimal_task_is_accepted_with_the_model_defaults_filled_in(tasks):
    minimal = {"steps": [{"name": "ship", "exec": {"command": ["ship"], "env": [{"name": "MODE"}]}}]}
    tasks.apply("minimal", minimal, check=True)
    stored = tasks.get("minimal")["spec"]
    assert stored == TaskSpec.model_validate(minimal).to_json()
    assert stored["retry"]["backoff"] == {"initialSeconds": 1, "maxSeconds": 300, "factor": 2}
    assert stored["steps"][0]["timeoutSeconds"] == 300 and stored["lease"]["durationSeconds"] == 15


def test_every_task_example_in_the_docs_is_accepted(tasks):
    examples = docs_task_examples()
    assert len(examples) >= 3
    for example in examples:
        tasks.kubectl("apply", "-f", "-", input=as_json(example))
        stored = tasks.get(example["metadata"]["name"])["spec"]
        assert stored == TaskSpec.model_validate(example["spec"]).to_json()


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda refusal: refusal.id)
def test_bad_manifest_is_refused_with_the_documented_message(tasks, refusal):
    refused = tasks.apply(refusal.id, copy.deepcopy(refusal.spec))
    assert refused.returncode != 0
    assert refusal_lines(refused.stderr, refusal.id) == set(refusal.server_errors)
    assert tasks.kubectl("get", "task", refusal.id, check=False).returncode != 0


def test_largest_task_the_schema_allows_stays_within_the_cel_cost_budget(tasks):
    # The API server caps the CEL cost of one request; the rules that scale with the object
    # (unique names, env names, the spec's immutability) must fit even when every list is full.
    env = [{"name": f"{i:03d}".rjust(128, "V"), "value": "v"} for i in range(64)]
    action = {"exec": {"command": ["run"], "env": env}}
    steps = [{"name": f"{i:02d}".rjust(63, "s"), **action, "verify": action} for i in range(models.MAX_STEPS)]
    # 1.3 MB: the API server stores it, the operator refuses it by the spec's size cap (the model's).
    with pytest.raises(ValueError, match=re.escape(models.MSG_SPEC_TOO_LARGE)):
        TaskSpec.model_validate({"steps": steps})
    # create, not apply: apply's last-applied annotation would exceed the 256 KiB annotation limit.
    created = tasks.apply("largest", {"steps": steps}, verb="create")
    assert created.returncode == 0, created.stderr
    updated = tasks.patch_spec("largest", {"spec": {"cancel": True}})
    assert updated.returncode == 0, updated.stderr


def regex(pattern: str, max_size: int) -> st.SearchStrategy[str]:
    return st.from_regex(pattern, fullmatch=True).filter(lambda value: len(value) <= max_size)


def not_secret_looking(pattern: str) -> Callable[[str], bool]:
    return lambda name: not re.search(pattern, name)


words = st.text(st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"]), max_size=12)
# Integers only: a float such as 2.0 comes back from the API server as 2, equal but not identical.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | words,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(words, children, max_size=3),
    max_leaves=8,
)
env_vars = st.fixed_dictionaries(
    {"name": regex(models.ENV_NAME_PATTERN, 128).filter(not_secret_looking(models.SECRET_ENV_NAME_PATTERN))},
    optional={"value": words},
)
exec_actions = st.fixed_dictionaries(
    {"command": st.lists(words, min_size=1, max_size=3)},
    optional={"args": st.lists(words, max_size=3), "env": st.lists(env_vars, max_size=3, unique_by=lambda e: e["name"])},
)
http_actions = st.fixed_dictionaries(
    {"method": st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]), "url": regex(models.URL_PATTERN, 2048)},
    optional={
        "headers": st.dictionaries(
            regex(models.HEADER_NAME_PATTERN, 64).filter(not_secret_looking(models.SECRET_HEADER_PATTERN)), words, max_size=3
        ),
        "body": json_values,
    },
)
python_actions = st.fixed_dictionaries(
    {"callable": regex(models.CALLABLE_PATTERN, 512)}, optional={"args": st.dictionaries(words, json_values, max_size=3)}
)
exit_codes = st.lists(st.integers(0, 255), max_size=4)
statuses = st.lists(st.integers(100, 599), max_size=4)
# An action with the failure classification that fits its kind.
step_bodies = st.one_of(
    st.tuples(
        exec_actions.map(lambda a: {"exec": a}),
        st.one_of(st.just({}), exit_codes.map(lambda c: {"retryableExitCodes": c}), exit_codes.map(lambda c: {"permanentExitCodes": c})),
    ),
    st.tuples(
        http_actions.map(lambda a: {"http": a}),
        st.one_of(st.just({}), statuses.map(lambda c: {"retryableStatuses": c}), statuses.map(lambda c: {"permanentStatuses": c})),
    ),
    st.tuples(python_actions.map(lambda a: {"python": a}), st.just({})),
)
verifies = st.one_of(
    exec_actions.map(lambda a: {"exec": a}), http_actions.map(lambda a: {"http": a}), python_actions.map(lambda a: {"python": a})
)
steps = st.builds(
    lambda name, body, extra: {"name": name, **body[0], **body[1], **extra},
    regex(models.DNS_LABEL_PATTERN, 63),
    step_bodies,
    st.fixed_dictionaries(
        {}, optional={"verify": verifies, "idempotent": st.booleans(), "timeoutSeconds": st.integers(1, 86400)}
    ),
)
backoffs = st.floats(0.1, 3600).flatmap(
    lambda initial: st.fixed_dictionaries(
        {"initialSeconds": st.just(initial), "maxSeconds": st.floats(initial, 86400), "factor": st.floats(1, 10)}
    )
)
times = st.datetimes(datetime(2000, 1, 1), datetime(2100, 1, 1), timezones=st.just(UTC))
specs = st.fixed_dictionaries(
    {"steps": st.lists(steps, min_size=1, max_size=4, unique_by=lambda s: s["name"])},
    optional={
        "payload": st.dictionaries(words, json_values, max_size=4),
        "retry": st.fixed_dictionaries(
            {},
            optional={
                "maxAttempts": st.integers(1, 100),
                "maxDisruptions": st.integers(0, 1000),
                "backoff": backoffs,
                "jitter": st.sampled_from(["Full", "None"]),
            },
        ),
        "lease": st.fixed_dictionaries({"durationSeconds": st.integers(5, 600)}),
        "timeoutSeconds": st.integers(1, 604800),
        "notBefore": times.map(lambda t: t.isoformat().replace("+00:00", "Z")),
        "concurrencyKey": regex(models.KEY_PATTERN, 253),
        "priority": st.integers(-1000, 1000),
        "idempotencyKey": regex(models.KEY_PATTERN, 253),
        "cancel": st.booleans(),
        "worker": st.fixed_dictionaries(
            {},
            optional={
                "image": words.filter(bool),
                "serviceAccountName": regex(models.DNS_SUBDOMAIN_PATTERN, 253),
                "resources": st.fixed_dictionaries(
                    {}, optional={"requests": st.dictionaries(st.sampled_from(["cpu", "memory"]), st.sampled_from(["100m", "1Gi", 2]))}
                ),
                "nodeSelector": st.dictionaries(words, words, max_size=2),
            },
        ),
    },
)
generated_names = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(spec=specs)
def test_every_spec_the_model_accepts_the_api_server_accepts_and_stores_as_the_model_reads_it(tasks, spec):
    wire = TaskSpec.model_validate(spec).to_json()
    name = f"generated-{next(generated_names)}"
    created = tasks.apply(name, spec, verb="create")
    assert created.returncode == 0, created.stderr
    assert tasks.get(name)["spec"] == wire
    tasks.kubectl("delete", "task", name, "--wait=false")


def test_unknown_field_is_refused_by_strict_field_validation(tasks):
    refused = tasks.apply("unknown-field", spec_with(step("only", exec={"command": ["x"]}, retries=3)))
    assert refused.returncode != 0
    assert refused.stderr.strip().endswith('strict decoding error: unknown field "spec.steps[0].retries"')


@pytest.fixture
def running_task(tasks, request) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower().removeprefix("test_"))[:63].strip("-")
    spec = spec_with(
        step("reserve", http={"method": "POST", "url": "https://inventory.example/reservations", "body": {"order": 42}}),
        step("ship", exec={"command": ["ship"]}),
        payload={"order": 42, "lines": [{"sku": "A-1", "qty": 2}]},
        idempotencyKey="order-42",
    )
    tasks.apply(name, spec, check=True)
    return name


def immutable(field: str) -> str:
    return f"spec.{field}: Invalid value: {models.immutable_message(field)}"


@pytest.mark.parametrize(
    ("patch", "error"),
    [
        pytest.param(
            {"spec": {"steps": [{"name": "other", "exec": {"command": ["x"]}}]}}, immutable("steps"), id="replacing-the-steps"
        ),
        pytest.param(
            [{"op": "replace", "path": "/spec/steps/0/http/body/order", "value": 43}],
            immutable("steps"),
            id="editing-free-form-json-inside-a-step",
        ),
        pytest.param(
            [{"op": "replace", "path": "/spec/payload/lines/0/qty", "value": 3}], immutable("payload"), id="editing-the-payload"
        ),
        pytest.param([{"op": "remove", "path": "/spec/payload"}], immutable("payload"), id="removing-the-payload"),
        pytest.param({"spec": {"idempotencyKey": "order-43"}}, immutable("idempotencyKey"), id="changing-the-idempotency-key"),
        pytest.param({"spec": {"priority": 100}}, immutable("priority"), id="raising-the-priority"),
        pytest.param({"spec": {"retry": {"maxAttempts": 10}}}, immutable("retry"), id="raising-the-retry-budget"),
        pytest.param({"spec": {"worker": {"image": "other:1"}}}, immutable("worker"), id="adding-a-worker-image"),
    ],
)
def test_spec_of_a_created_task_cannot_change(tasks, running_task, patch, error):
    # The operator runs the spec it admitted; an accepted edit would be silently ignored.
    refused = tasks.patch_spec(running_task, patch, type="json" if isinstance(patch, list) else "merge")
    assert refused.returncode != 0
    assert refusal_lines(refused.stderr, running_task) == {error}


def test_cancel_can_be_set_but_not_undone(tasks, running_task):
    assert tasks.patch_spec(running_task, {"spec": {"cancel": True}}).returncode == 0
    undone = tasks.patch_spec(running_task, {"spec": {"cancel": False}})
    assert undone.returncode != 0
    assert refusal_lines(undone.stderr, running_task) == {
        f"spec.cancel: Invalid value: false: {models.MSG_CANCEL_IRREVERSIBLE}"
    }
    assert tasks.get(running_task)["spec"]["cancel"] is True


def test_oversized_payload_is_stored_by_the_api_server_and_refused_by_the_model(tasks):
    # CEL can compare free-form JSON but not measure it: the byte limit is the model's (the
    # operator admits a task through it), and this test pins that division of labour.
    spec = spec_with(payload={"blob": "x" * models.PAYLOAD_MAX_BYTES})
    tasks.apply("oversized-payload", spec, check=True)
    stored = tasks.get("oversized-payload")["spec"]
    with pytest.raises(ValueError, match=models.MSG_PAYLOAD_TOO_LARGE):
        TaskSpec.model_validate(stored)


def test_kubectl_explain_shows_the_model_docstrings(tasks):
    steps = tasks.rig.kubectl("explain", "task.spec.steps").stdout
    assert "One step: exactly one action (exec, http or python)" in steps
    assert "A read-only check, run when the step's outcome is unknown" in " ".join(steps.split())
    backoff = " ".join(tasks.rig.kubectl("explain", "task.spec.retry.backoff").stdout.split())
    assert "Exponential backoff between attempts" in backoff and "Cap on the delay." in backoff


def full_status() -> TaskStatus:
    conditions = set_condition([], ConditionType.ACCEPTED, "True", "Valid", "spec recorded", observed_generation=1, now=T0)
    conditions = set_condition(
        conditions, ConditionType.RUNNING, "True", "AttemptStarted", "attempt 2 on node-b", observed_generation=1, now=T0
    )
    return TaskStatus(
        phase=TaskPhase.RUNNING,
        attempt=2,
        completed_steps=1,
        total_steps=2,
        steps=[
            StepStatus(
                name="reserve",
                state=StepState.DONE,
                attempt=1,
                started_at=T0,
                finished_at=T0 + timedelta(seconds=3),
                result='{"reservation": "r-981"}',
            ),
            StepStatus(name="ship", state=StepState.STARTED, attempt=2, started_at=T0 + timedelta(seconds=40), error="worker lost"),
        ],
        lease=LeaseStatus(holder="ship-order-42-2-xk2p9", renewed_at=T0 + timedelta(seconds=41), duration_seconds=15),
        retries=0,
        disruptions=1,
        conditions=conditions,
        ledger_version=7,
        observed_generation=1,
        start_time=T0,
        last_error="attempt 1: node node-a lost",
    )


def test_full_status_round_trips_through_the_status_subresource_without_pruning(tasks, running_task):
    status = full_status()
    tasks.write_status(running_task, status)
    stored = tasks.get(running_task)["status"]
    assert stored == status.to_json()
    assert TaskStatus.model_validate(stored) == status


long_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6000)
step_statuses = st.builds(
    StepStatus,
    name=regex(models.DNS_LABEL_PATTERN, 63),
    state=st.sampled_from(StepState),
    attempt=st.none() | st.integers(0, 1000),
    started_at=st.none() | times,
    finished_at=st.none() | times,
    result=st.none() | long_text,
    error=st.none() | long_text,
)
condition_updates = st.lists(
    st.tuples(
        st.sampled_from(ConditionType),
        st.sampled_from(["True", "False", "Unknown"]),
        regex(models.CONDITION_REASON_PATTERN, 1024),
        long_text,
        times,
    ),
    max_size=8,
)


@st.composite
def task_statuses(draw) -> TaskStatus:
    conditions: list[Condition] = []
    for type, status, reason, message, now in draw(condition_updates):
        conditions = set_condition(conditions, type, status, reason, message, observed_generation=1, now=now)
    total = draw(st.integers(0, models.MAX_STEPS))
    return TaskStatus(
        phase=draw(st.none() | st.sampled_from(TaskPhase)),
        attempt=draw(st.none() | st.integers(0, 1000)),
        completed_steps=draw(st.integers(0, total)),
        total_steps=total,
        steps=draw(st.lists(step_statuses, max_size=5, unique_by=lambda step: step.name)) or None,
        lease=draw(st.none() | st.builds(LeaseStatus, holder=words, renewed_at=times, duration_seconds=st.integers(1, 600))),
        retries=draw(st.none() | st.integers(0, 100)),
        disruptions=draw(st.none() | st.integers(0, 100)),
        conditions=conditions or None,
        start_time=draw(st.none() | times),
        completion_time=draw(st.none() | times),
        last_error=draw(st.none() | long_text),
    )


@pytest.fixture(scope="module")
def status_target(tasks) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """A task whose status a test replaces through the Python client, as the operator writes it."""
    tasks.apply("status-target", spec_with(), check=True)
    with tasks.rig.api_client() as api:
        objects = kubernetes.client.CustomObjectsApi(api)
        where = (models.GROUP, models.VERSION, NAMESPACE, models.PLURAL, "status-target")
        yield lambda json_patch: objects.patch_namespaced_custom_object_status(
            *where, json_patch, _content_type="application/json-patch+json"
        )


ledger_versions = itertools.count(1)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(status=task_statuses())
def test_every_status_the_model_builds_is_stored_by_the_api_server_unchanged(status_target, status):
    # Long results, errors and messages are truncated by the model to limits the API server accepts.
    status = status.model_copy(update={"ledger_version": next(ledger_versions)})
    stored = status_target([{"op": "add", "path": "/status", "value": status.to_json()}])["status"]
    assert stored == status.to_json()
    assert TaskStatus.model_validate(stored) == status


def test_status_written_with_the_spec_is_ignored(tasks):
    manifest = {
        "apiVersion": models.API_VERSION,
        "kind": models.KIND,
        "metadata": {"name": "status-in-manifest"},
        "spec": spec_with(),
        "status": {"phase": "Succeeded"},
    }
    tasks.kubectl("apply", "-f", "-", input=as_json(manifest))
    assert "status" not in tasks.get("status-in-manifest")


def test_kubectl_get_tasks_shows_phase_progress_and_attempt(tasks, running_task):
    tasks.write_status(running_task, full_status())
    table = tasks.kubectl("get", "tasks", running_task).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "PROGRESS", "ATTEMPT", "AGE"]
    assert table[1].split()[:4] == [running_task, "Running", "1/2", "2"]
    wide = tasks.kubectl("get", "rtask", running_task, "-o", "wide").stdout.splitlines()
    assert wide[0].split() == ["NAME", "PHASE", "PROGRESS", "ATTEMPT", "RETRIES", "DISRUPTIONS", "AGE"]
    assert wide[1].split()[:6] == [running_task, "Running", "1/2", "2", "0", "1"]
    assert running_task in tasks.kubectl("get", "retex").stdout


def test_status_ledger_version_never_goes_backwards(tasks, running_task):
    tasks.write_status(running_task, TaskStatus(phase=TaskPhase.RUNNING, ledger_version=7))
    stale = tasks.write_status(running_task, TaskStatus(phase=TaskPhase.QUEUED, ledger_version=6), check=False)
    assert stale.returncode != 0
    assert refusal_lines(stale.stderr, running_task) == {f"status: Invalid value: {models.MSG_LEDGER_VERSION_MONOTONIC}"}
    assert tasks.get(running_task)["status"]["phase"] == "Running"


def test_kubectl_wait_sees_the_succeeded_condition(tasks, running_task):
    conditions = set_condition([], ConditionType.SUCCEEDED, "True", "AllStepsDone", "", observed_generation=1, now=T0)
    done = TaskStatus(phase=TaskPhase.SUCCEEDED, completed_steps=2, total_steps=2, conditions=conditions, ledger_version=9)
    tasks.write_status(running_task, done)
    waited = tasks.kubectl("wait", "--for=condition=Succeeded", f"task/{running_task}", "--timeout=10s", check=False)
    assert waited.returncode == 0, waited.stderr
    assert isinstance(Condition.model_validate(tasks.get(running_task)["status"]["conditions"][0]), Condition)


# A CRD like Tekton's tasks.tekton.dev: kind Task, plural tasks, in another group. The API server
# lists groups of equal priority by name, and kubectl takes a bare `tasks` or `task/<name>` from the
# first: this group sorts before retex.dev, so they mean its Tasks, not retex's (the test checks
# that they do: otherwise it proves nothing). Tekton's own group sorts after retex.dev; any other
# CRD with plural `tasks` may sort before it.
CLASHING_GROUP = "builds.example.dev"
CLASHING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"tasks.{CLASHING_GROUP}"},
    "spec": {
        "group": CLASHING_GROUP,
        "names": {"kind": "Task", "listKind": "TaskList", "plural": "tasks", "singular": "task"},
        "scope": "Namespaced",
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}
# The names the docs' commands use, as retex Tasks in the tour's namespace.
DOCS_TASK_NAMES = ("order-1042", "order-1043", "notify-partner")
DOCS_WITH_COMMANDS = (ROOT / "README.md", ROOT / "docs" / "contributing" / "development.md", ROOT / "docs" / "api.md")


def documented_kubectl_commands() -> list[list[str]]:
    """Every `$ kubectl ...` line of the console blocks of the README, the development tour and
    api.md, as argv."""
    commands = []
    for doc in DOCS_WITH_COMMANDS:
        for block in re.findall(r"```console\n(.*?)```", doc.read_text(), flags=re.S):
            commands += [shlex.split(line[2:], comments=True) for line in block.splitlines()
                         if line.startswith("$ kubectl ")]
    return commands


def run_as_written(argv: list[str], kubeconfig: Path) -> subprocess.CompletedProcess:
    """A documented command with KUBECONFIG set, as the tour does; a watch (-w) runs 5 s."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    if "-w" not in argv:
        return subprocess.run(argv, env=env, text=True, capture_output=True, timeout=60)
    with subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as watch:
        try:
            stdout, stderr = watch.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            watch.terminate()
            stdout, stderr = watch.communicate()
    return subprocess.CompletedProcess(argv, 0 if stdout else 1, stdout, stderr)


@pytest.fixture
def clashing_tasks_crd(tasks):
    """The clashing CRD installed, with a Task of its own; removed after, and kubectl's discovery
    cache refreshed both times (a stale cache would send a bare `task` to the wrong group)."""
    rig = tasks.rig
    rig.kubectl("apply", "-f", "-", input=as_json(CLASHING_CRD))
    wait_established(rig.kubectl, f"tasks.{CLASHING_GROUP}")
    rig.kubectl("api-resources", f"--api-group={CLASHING_GROUP}")
    yield
    rig.kubectl("delete", "crd", f"tasks.{CLASHING_GROUP}", "--wait=true", "--timeout=60s")
    rig.kubectl("api-resources")


def test_the_documented_kubectl_commands_reach_retex_tasks_beside_another_crd_named_tasks(
        tasks, clashing_tasks_crd, tmp_path):
    namespace = f"{NAMESPACE}-docs"
    prepare_namespace(tasks.rig.kubectl, namespace)
    try:
        tasks.rig.kubectl("apply", "-n", namespace, "-f", "-", input=as_json(
            {"apiVersion": f"{CLASHING_GROUP}/v1", "kind": "Task", "metadata": {"name": "build"}, "spec": {}}))
        # What the commands read; the conditions are the ones the docs wait for. No observedGeneration:
        # kubectl wait skips a condition older than the object's generation, and the docs' cancel
        # patch makes one with no operator here to write a newer status.
        conditions = []
        for kind in (ConditionType.SUCCEEDED, ConditionType.DEAD_LETTERED, ConditionType.COMPLETED):
            conditions = set_condition(conditions, kind, "True", "Shown", "", observed_generation=None, now=T0)
        for name in DOCS_TASK_NAMES:
            tasks.rig.kubectl("apply", "-n", namespace, "-f", "-", input=as_json({
                "apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": name}, "spec": spec_with()}))
            shown = TaskStatus(phase=TaskPhase.SUCCEEDED, conditions=conditions, ledger_version=1)
            tasks.rig.kubectl("patch", "-n", namespace, f"{models.PLURAL}.{models.GROUP}", name, "--subresource=status",
                              "--type=merge", "-p", as_json({"status": shown.to_json()}))
        bare = tasks.rig.kubectl("get", "tasks", "-n", namespace, "-o", "name").stdout.split()
        assert bare == [f"task.{CLASHING_GROUP}/build"], f"a bare `tasks` should mean the other group's: {bare}"

        kubeconfig = tmp_path / "kubeconfig"  # the tour's `kubectl config set-context` edits it
        kubeconfig.write_text(Path(tasks.rig.kubeconfig).read_text())
        verbs = set()
        for argv in documented_kubectl_commands():
            verb = argv[1]
            if verb == "config":  # the tour's namespace, made this test's
                argv = [arg.replace("retex-examples", namespace) for arg in argv]
            elif verb not in ("get", "wait", "describe", "patch", "explain"):
                continue  # apply and annotate name the group in the manifest
            ran = run_as_written(argv, kubeconfig)
            assert ran.returncode == 0, f"{shlex.join(argv)}: {ran.stderr}"
            verbs.add(verb)
            said = ran.stdout
            if verb == "get" and ("-o" not in argv or "wide" in argv):
                # retex's Task table (`get retex` also lists TaskPolicies, in a table of their own)
                headers = [line.split()[:2] for line in said.splitlines() if line.startswith("NAME")]
                assert ["NAME", "PHASE"] in headers, f"{shlex.join(argv)} did not list retex Tasks: {said}"
            elif verb in ("wait", "patch"):
                assert said.startswith(f"task.{models.GROUP}/"), f"{shlex.join(argv)}: {said}"
            elif verb == "describe":
                assert f"API Version:  {models.API_VERSION}" in said, f"{shlex.join(argv)}: {said}"
            elif verb == "explain":
                assert said.split()[:2] == ["GROUP:", models.GROUP], f"{shlex.join(argv)}: {said}"
        assert verbs == {"config", "get", "wait", "describe", "patch", "explain"}, verbs
    finally:
        discard_namespace(tasks.rig.kubectl, namespace)
