"""The Task models: what they accept, their defaults, their wire form, and the status they build."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from retex.api import (
    Condition,
    ConditionType,
    HttpAction,
    Step,
    StepStatus,
    Task,
    TaskSpec,
    TaskStatus,
    models,
)
from retex.api.models import ERROR_MAX_CHARS, STEP_RESULT_MAX_CHARS
from retex.machine import StepState, TaskPhase

T0 = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def docs_task_examples() -> list[dict[str, Any]]:
    """The Task manifests in docs/api.md (also applied to the API server by the cluster tests)."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc and doc.get("kind") == "Task"]


def test_every_task_example_in_the_docs_is_valid():
    examples = docs_task_examples()
    assert [example["metadata"]["name"] for example in examples] == [
        "order-1042",
        "nightly-etl-2026-12-02",
        "reminder-c-77",
        "month-end",
    ]
    for example in examples:
        Task.model_validate(example)


def test_minimal_spec_gets_documented_defaults():
    spec = TaskSpec.model_validate({"steps": [{"name": "ship", "exec": {"command": ["ship"]}}]})
    assert spec.retry.max_attempts == 3 and spec.retry.max_disruptions == 10
    assert (spec.retry.backoff.initial_seconds, spec.retry.backoff.max_seconds, spec.retry.backoff.factor) == (1, 300, 2)
    assert spec.retry.jitter == "Full"
    assert spec.lease.duration_seconds == 15
    assert spec.priority == 0 and spec.cancel is False
    assert spec.timeout_seconds is None and spec.not_before is None and spec.payload is None
    assert spec.steps[0].timeout_seconds == 300 and spec.steps[0].idempotent is False


def test_wire_form_is_camel_case_and_omits_unset_fields():
    spec = TaskSpec.model_validate(
        {"steps": [{"name": "ship", "exec": {"command": ["ship"]}, "timeoutSeconds": 30}], "notBefore": "2026-12-24T18:00:00Z"}
    )
    wire = spec.to_json()
    assert wire["notBefore"] == "2026-12-24T18:00:00Z"
    assert wire["steps"] == [{"name": "ship", "exec": {"command": ["ship"]}, "idempotent": False, "timeoutSeconds": 30}]
    assert "worker" not in wire and "payload" not in wire
    assert TaskSpec.model_validate(wire) == spec


def test_python_code_may_use_snake_case_names():
    step = Step(name="charge", http=HttpAction(method="POST", url="https://pay.example/charges"), timeout_seconds=10)
    assert step.to_json()["timeoutSeconds"] == 10


def test_a_full_spec_with_every_default_written_out_round_trips_through_its_wire_form():
    wire = {
        "steps": [
            {
                "name": "reserve",
                "http": {
                    "method": "POST",
                    "url": "https://inventory.example/reservations?order=42",
                    "headers": {"X-Request-Source": "retex"},
                    "body": {"order": 42, "lines": [{"sku": "A-1", "qty": 2}], "note": None},
                },
                "verify": {"http": {"method": "GET", "url": "https://inventory.example/reservations/42"}},
                "idempotent": False,
                "timeoutSeconds": 300,
                "retryableStatuses": [409, 503],
            },
            {
                "name": "charge",
                "python": {"callable": "shop.payments:charge", "args": {"currency": "EUR"}},
                "idempotent": True,
                "timeoutSeconds": 300,
            },
            {
                "name": "label",
                "exec": {"command": ["label"], "args": ["--order", "42"], "env": [{"name": "PRINTER", "value": "zebra-1"}]},
                "idempotent": False,
                "timeoutSeconds": 60,
                "permanentExitCodes": [2],
            },
        ],
        "payload": {"order": 42, "customer": {"id": "c-7"}},
        "retry": {"maxAttempts": 5, "maxDisruptions": 3, "backoff": {"initialSeconds": 0.5, "maxSeconds": 60, "factor": 3}, "jitter": "None"},
        "lease": {"durationSeconds": 30},
        "timeoutSeconds": 3600,
        "notBefore": "2026-12-24T18:00:00Z",
        "concurrencyKey": "customer/c-7",
        "priority": 10,
        "idempotencyKey": "order-42",
        "cancel": False,
        "worker": {
            "image": "registry.example/shop-worker:1.4",
            "serviceAccountName": "shop-worker",
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
            "nodeSelector": {"pool": "workers"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "shop", "effect": "NoSchedule"}],
        },
    }
    assert TaskSpec.model_validate(wire).to_json() == wire


@pytest.mark.parametrize("name", ["GITHUB_TOKEN", "db_password", "AWS_SECRET_ACCESS_KEY", "STRIPE_API_KEY", "ApiKey"])
def test_credential_looking_env_names_are_refused(name):
    with pytest.raises(ValidationError, match="look like credentials"):
        TaskSpec.model_validate({"steps": [{"name": "s", "exec": {"command": ["x"], "env": [{"name": name}]}}]})


@pytest.mark.parametrize("header", ["Authorization", "PROXY-AUTHORIZATION", "cookie"])
def test_credential_headers_are_refused(header):
    with pytest.raises(ValidationError, match="headers are refused"):
        HttpAction(method="GET", url="https://x.example/", headers={header: "v"})


FROM_SECRET = {"secretKeyRef": {"name": "payments.api", "key": "bearer"}}


def test_credentials_are_named_from_a_secret_in_env_and_headers_never_written():
    spec = TaskSpec.model_validate({"steps": [
        {"name": "a", "exec": {"command": ["x"], "env": [{"name": "GITHUB_TOKEN", "valueFrom": FROM_SECRET}]}},
        {"name": "b", "http": {"method": "GET", "url": "https://x.example/",
                               "headersFrom": [{"name": "Authorization", "valueFrom": FROM_SECRET}]},
         "verify": {"http": {"method": "GET", "url": "https://x.example/",
                             "headersFrom": [{"name": "Cookie", "valueFrom": {"secretKeyRef": {"name": "c", "key": "k"}}}]}}},
    ]})
    assert [(r.name, r.key) for r in spec.secret_refs()] == [("payments.api", "bearer"), ("c", "k")]
    assert spec.secret_refs()[0].env_name.startswith("RETEX_SECRET_")
    assert spec.secret_refs()[0].env_name != spec.secret_refs()[1].env_name


def test_an_env_item_has_a_value_or_a_secret_not_both():
    with pytest.raises(ValidationError, match="set value or valueFrom, not both"):
        TaskSpec.model_validate({"steps": [{"name": "s", "exec": {"command": ["x"], "env": [
            {"name": "MODE", "value": "fast", "valueFrom": FROM_SECRET}]}}]})


def test_status_progress_is_filled_in_from_the_step_counts():
    status = TaskStatus(phase=TaskPhase.RUNNING, completed_steps=2, total_steps=5)
    assert status.progress == "2/5"
    assert status.to_json() == {"phase": "Running", "progress": "2/5", "completedSteps": 2, "totalSteps": 5}


def test_status_refuses_progress_that_disagrees_with_the_counts():
    with pytest.raises(ValidationError, match="disagrees"):
        TaskStatus(progress="3/5", completed_steps=2, total_steps=5)
    with pytest.raises(ValidationError, match="cannot exceed"):
        TaskStatus(completed_steps=6, total_steps=5)


def test_long_step_results_and_errors_are_truncated_to_their_limits():
    step = StepStatus(name="s", state=StepState.FAILED, result="r" * 5000, error="e" * 10000)
    assert len(step.result) == STEP_RESULT_MAX_CHARS and step.result.endswith("…")
    assert len(step.error) == ERROR_MAX_CHARS
    assert len(TaskStatus(last_error="x" * 9000).last_error) == ERROR_MAX_CHARS


def test_status_timestamps_must_carry_a_timezone():
    with pytest.raises(ValidationError, match="timezone"):
        StepStatus(name="s", state=StepState.STARTED, started_at=datetime(2026, 12, 2, 9, 0, 0))


def test_status_wire_form_uses_rfc3339_utc_timestamps():
    condition = Condition(type=ConditionType.ACCEPTED, status="True", reason="Valid", last_transition_time=T0)
    assert condition.to_json() == {
        "type": "Accepted",
        "status": "True",
        "lastTransitionTime": "2026-12-02T09:00:00Z",
        "reason": "Valid",
        "message": "",
    }


def test_status_reader_ignores_fields_it_does_not_know():
    assert TaskStatus.model_validate({"phase": "Queued", "addedLater": 1}).phase == TaskPhase.QUEUED


def test_task_parses_an_object_as_the_api_server_returns_it():
    obj = {
        "apiVersion": "retex.dev/v1alpha1",
        "kind": "Task",
        "metadata": {"name": "order-42", "namespace": "shop", "generation": 1, "uid": "9608284e"},
        "spec": {"steps": [{"name": "ship", "exec": {"command": ["ship"]}, "idempotent": False, "timeoutSeconds": 300}]},
        "status": {"phase": "Running", "attempt": 1, "completedSteps": 0, "totalSteps": 1, "progress": "0/1"},
    }
    task = Task.model_validate(obj)
    assert task.metadata["name"] == "order-42"
    assert task.status.phase == TaskPhase.RUNNING and task.spec.steps[0].name == "ship"


@pytest.mark.parametrize("value", ["a\r\nX-Injected: 1", "a\nb", "a\rb", "a\x00b"])
def test_header_values_with_cr_lf_or_nul_are_refused(value):
    with pytest.raises(ValidationError, match=models.MSG_HEADER_VALUE):
        HttpAction(method="GET", url="https://x.example/", headers={"X-Note": value})


def test_the_renew_deadline_defaults_to_two_thirds_and_must_leave_the_kill_time_below_the_duration():
    assert TaskSpec.model_validate({"steps": [{"name": "a", "exec": {"command": ["true"]}}]}).lease \
        .renew_deadline_seconds is None
    assert models.default_renew_deadline_seconds(15) == 10
    ok = {"durationSeconds": 10, "renewDeadlineSeconds": 8}  # 8 + 1 < 10
    assert TaskSpec.model_validate({"steps": [{"name": "a", "exec": {"command": ["true"]}}], "lease": ok})
    for broken in ({"durationSeconds": 10, "renewDeadlineSeconds": 9}, {"renewDeadlineSeconds": 14}):
        with pytest.raises(ValidationError, match=re.escape(models.MSG_RENEW_DEADLINE)):
            TaskSpec.model_validate({"steps": [{"name": "a", "exec": {"command": ["true"]}}], "lease": broken})


@pytest.mark.parametrize("carrier", ["http-body", "python-args", "spread-over-steps"])
def test_a_spec_over_the_size_cap_is_refused_whatever_part_of_it_carries_the_bytes(carrier):
    """Only the payload had a cap; http bodies and python args rode on the object unbounded (the
    API server's request limit is megabytes, and every byte goes to the ledger and each worker)."""
    big = "x" * (models.SPEC_MAX_BYTES + 1)
    steps = {
        "http-body": [{"name": "a", "http": {"method": "POST", "url": "https://x.example/", "body": {"blob": big}}}],
        "python-args": [{"name": "a", "python": {"callable": "m:f", "args": {"blob": big}}}],
        # Each part well under any single limit (the payload's 64 KiB included), together over the cap.
        "spread-over-steps": [{"name": f"s{i}", "python": {"callable": "m:f", "args": {"blob": "x" * 60_000}}}
                              for i in range(5)],
    }[carrier]
    with pytest.raises(ValueError, match=re.escape(models.MSG_SPEC_TOO_LARGE)):
        TaskSpec.model_validate({"steps": steps})


def test_a_spec_just_under_the_size_cap_with_a_full_payload_is_accepted():
    payload = {"blob": "x" * (models.PAYLOAD_MAX_BYTES - 20)}
    steps = [{"name": "a", "python": {"callable": "m:f", "args": {"blob": "y" * 150_000}}}]
    spec = TaskSpec.model_validate({"steps": steps, "payload": payload})
    assert models.payload_bytes(spec.as_admitted()) < models.SPEC_MAX_BYTES


@pytest.mark.parametrize("url", ["http://:80/x", "http://host:abc/", "http://host:99999/", "http://host:0/", "http://[::1/"])
def test_a_url_without_a_host_or_with_a_port_out_of_range_is_refused(url):
    """An http step's worker must never meet a URL it cannot send to (it could not say whether
    anything was sent)."""
    with pytest.raises(ValidationError, match="String should match pattern"):
        TaskSpec.model_validate({"steps": [{"name": "only", "http": {"method": "GET", "url": url}}]})


@pytest.mark.parametrize("url", ["https://[::1]:443/x", "http://shop.example:65535", "http://10.0.0.7:8080/a?b#c"])
def test_a_url_with_a_host_and_a_port_in_range_is_accepted(url):
    TaskSpec.model_validate({"steps": [{"name": "only", "http": {"method": "GET", "url": url}}]})


def test_the_shown_phases_are_the_ledgers_phases_refused_and_ledger_behind():
    from retex.api.models import LEDGER_BEHIND, REFUSED, ShownPhase

    assert {(p.name, p.value) for p in ShownPhase} == {(p.name, p.value) for p in TaskPhase} | {
        ("REFUSED", REFUSED), ("LEDGER_BEHIND", LEDGER_BEHIND)}
