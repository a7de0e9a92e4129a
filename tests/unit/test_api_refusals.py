"""Bad Task specs and how they are refused: by the model here, by the real API server in
tests/cluster/test_task_api.py (which imports REFUSALS), so the two layers cannot drift apart.

`server_errors` are the API server's error lines as `kubectl apply` prints them (order-free);
`model_error` is a fragment of the pydantic error: the shared message for CEL rules, pydantic's
own wording for OpenAPI-level checks (patterns, enums, bounds)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

from retex.api import models
from retex.api.models import TaskSpec

NOT_CHECKED = (
    "<nil>: Invalid value: null: some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)
EXEC = {"command": ["true"]}
HTTP = {"method": "GET", "url": "https://shop.example/orders/42"}


def spec_with(*steps: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"steps": list(steps) or [{"name": "only", "exec": EXEC}], **fields}


def step(name: str = "only", **fields: Any) -> dict[str, Any]:
    return {"name": name, **({"exec": EXEC} if not fields else fields)}


@dataclass(frozen=True)
class Refusal:
    id: str
    spec: dict[str, Any]
    server_errors: tuple[str, ...]
    model_error: str


REFUSALS = [
    Refusal(
        "two-steps-with-one-name",
        spec_with(step("charge"), step("charge")),
        (f"spec.steps: Invalid value: {models.MSG_UNIQUE_STEP_NAMES}",),
        models.MSG_UNIQUE_STEP_NAMES,
    ),
    Refusal(
        "step-with-exec-and-http",
        spec_with(step(exec=EXEC, http=HTTP)),
        (f"spec.steps[0]: Invalid value: {models.MSG_ONE_KIND}",),
        models.MSG_ONE_KIND,
    ),
    Refusal(
        "step-with-no-action",
        spec_with({"name": "empty", "idempotent": True}),
        (f"spec.steps[0]: Invalid value: {models.MSG_ONE_KIND}",),
        models.MSG_ONE_KIND,
    ),
    Refusal(
        "verify-with-two-actions",
        spec_with(step(exec=EXEC, verify={"exec": EXEC, "python": {"callable": "shop.checks:paid"}})),
        (f"spec.steps[0].verify: Invalid value: {models.MSG_ONE_KIND}",),
        models.MSG_ONE_KIND,
    ),
    Refusal(
        "http-method-outside-the-enum",
        spec_with(step(http={**HTTP, "method": "FETCH"})),
        ('spec.steps[0].http.method: Unsupported value: "FETCH": supported values: "GET", "POST", "PUT", "PATCH", "DELETE"', NOT_CHECKED),
        "Input should be 'GET', 'POST', 'PUT', 'PATCH' or 'DELETE'",
    ),
    Refusal(
        "jitter-outside-the-enum",
        spec_with(retry={"jitter": "Half"}),
        ('spec.retry.jitter: Unsupported value: "Half": supported values: "Full", "None"', NOT_CHECKED),
        "Input should be 'Full' or 'None'",
    ),
    Refusal(
        "numbers-out-of-range",
        spec_with(
            step(exec=EXEC, timeoutSeconds=0), retry={"maxAttempts": 0}, priority=5000, lease={"durationSeconds": 1}
        ),
        (
            "spec.lease.durationSeconds: Invalid value: 1: spec.lease.durationSeconds in body should be greater than or equal to 5",
            "spec.retry.maxAttempts: Invalid value: 0: spec.retry.maxAttempts in body should be greater than or equal to 1",
            "spec.steps[0].timeoutSeconds: Invalid value: 0: spec.steps[0].timeoutSeconds in body should be greater than or equal to 1",
            "spec.priority: Invalid value: 5000: spec.priority in body should be less than or equal to 1000",
        ),
        "4 validation errors",
    ),
    Refusal(
        "step-name-not-a-dns-label",
        spec_with(step("Reserve_Stock")),
        (
            "spec.steps[0].name: Invalid value: \"Reserve_Stock\": spec.steps[0].name in body should match "
            f"'{models.DNS_LABEL_PATTERN}'",
        ),
        "String should match pattern",
    ),
    Refusal(
        "step-name-longer-than-63",
        spec_with(step("a" * 64)),
        ("spec.steps[0].name: Too long: may not be more than 63 bytes", NOT_CHECKED),
        "String should have at most 63 characters",
    ),
    Refusal(
        "no-steps",
        {"steps": []},
        ("spec.steps: Invalid value: 0: spec.steps in body should have at least 1 items",),
        "List should have at least 1 item",
    ),
    Refusal(
        "more-than-64-steps",
        spec_with(*(step(f"s{i}") for i in range(65))),
        ("spec.steps: Too many: 65: must have at most 64 items", NOT_CHECKED),
        "List should have at most 64 items",
    ),
    Refusal(
        "credential-looking-env-name",
        spec_with(step(exec={**EXEC, "env": [{"name": "DB_PASSWORD", "value": "hunter2"}]})),
        (f"spec.steps[0].exec.env[0]: Invalid value: {models.MSG_SECRET_ENV_NAME}",),
        models.MSG_SECRET_ENV_NAME,
    ),
    Refusal(
        "authorization-header",
        spec_with(step(http={**HTTP, "headers": {"authorization": "Bearer abc"}})),
        (f"spec.steps[0].http.headers: Invalid value: {models.MSG_SECRET_HEADER}",),
        models.MSG_SECRET_HEADER,
    ),
    Refusal(
        "header-value-with-cr-lf",
        spec_with(step(http={**HTTP, "headers": {"X-Note": "a\r\nX-Injected: 1"}})),
        (
            'spec.steps[0].http.headers.X-Note: Invalid value: "a\\r\\nX-Injected: 1": '
            f"spec.steps[0].http.headers.X-Note in body should match '{models.HEADER_VALUE_PATTERN}'",
        ),
        models.MSG_HEADER_VALUE,
    ),
    Refusal(
        "credentials-in-url",
        spec_with(step(http={**HTTP, "url": "https://user:pw@shop.example/orders"})),
        (
            'spec.steps[0].http.url: Invalid value: "https://user:pw@shop.example/orders": spec.steps[0].http.url '
            f"in body should match '{models.URL_PATTERN}'",
        ),
        "String should match pattern",
    ),
    Refusal(
        "url-without-a-host",
        spec_with(step(http={**HTTP, "url": "http://:80/orders"})),
        (
            'spec.steps[0].http.url: Invalid value: "http://:80/orders": spec.steps[0].http.url '
            f"in body should match '{models.URL_PATTERN}'",
        ),
        "String should match pattern",
    ),
    Refusal(
        "url-with-a-port-out-of-range",
        spec_with(step(http={**HTTP, "url": "https://shop.example:99999/orders"})),
        (
            'spec.steps[0].http.url: Invalid value: "https://shop.example:99999/orders": spec.steps[0].http.url '
            f"in body should match '{models.URL_PATTERN}'",
        ),
        "String should match pattern",
    ),
    Refusal(
        "exit-codes-on-an-http-step",
        spec_with(step(http=HTTP, retryableExitCodes=[75])),
        (f"spec.steps[0]: Invalid value: {models.MSG_EXIT_CODES_EXEC_ONLY}",),
        models.MSG_EXIT_CODES_EXEC_ONLY,
    ),
    Refusal(
        "retryable-and-permanent-statuses",
        spec_with(step(http=HTTP, retryableStatuses=[503], permanentStatuses=[400])),
        (f"spec.steps[0]: Invalid value: {models.MSG_STATUSES_EXCLUSIVE}",),
        models.MSG_STATUSES_EXCLUSIVE,
    ),
    Refusal(
        "backoff-cap-below-initial-delay",
        spec_with(retry={"backoff": {"initialSeconds": 500}}),
        (f"spec.retry.backoff: Invalid value: {models.MSG_BACKOFF_ORDER}",),
        models.MSG_BACKOFF_ORDER,
    ),
    Refusal(
        "renew-deadline-leaves-no-time-to-kill-the-step",
        spec_with(lease={"durationSeconds": 10, "renewDeadlineSeconds": 9}),
        (f"spec.lease: Invalid value: {models.MSG_RENEW_DEADLINE}",),
        models.MSG_RENEW_DEADLINE,
    ),
    Refusal(
        "python-callable-without-function",
        spec_with(step(python={"callable": "shop.payments"})),
        (
            'spec.steps[0].python.callable: Invalid value: "shop.payments": spec.steps[0].python.callable in body '
            f"should match '{models.CALLABLE_PATTERN}'",
        ),
        "String should match pattern",
    ),
    Refusal(
        "not-before-not-a-date-time",
        spec_with(notBefore="tomorrow"),
        ('spec.notBefore: Invalid value: "tomorrow": spec.notBefore in body must be of type date-time: "tomorrow"', NOT_CHECKED),
        "Input should be a valid datetime",
    ),
    Refusal(
        "resource-quantity-not-a-quantity",
        spec_with(worker={"resources": {"requests": {"cpu": "lots"}}}),
        (
            'spec.worker.resources.requests.cpu: Invalid value: "lots": spec.worker.resources.requests.cpu in body '
            f"should match '{models.QUANTITY_PATTERN}'",
        ),
        "String should match pattern",
    ),
]


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda refusal: refusal.id)
def test_model_refuses_what_the_api_server_refuses(refusal):
    with pytest.raises(ValidationError) as refused:
        TaskSpec.model_validate(copy.deepcopy(refusal.spec))
    assert refusal.model_error in str(refused.value)


def test_unknown_fields_are_refused_by_the_model():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TaskSpec.model_validate(spec_with(step(exec=EXEC, retries=3)))


def test_oversized_payload_is_refused_by_the_model():
    payload = {"blob": "x" * models.PAYLOAD_MAX_BYTES}
    with pytest.raises(ValidationError, match=models.MSG_PAYLOAD_TOO_LARGE):
        TaskSpec.model_validate(spec_with(payload=payload))


def test_payload_at_the_limit_is_accepted():
    overhead = models.payload_bytes({"blob": ""})
    payload = {"blob": "x" * (models.PAYLOAD_MAX_BYTES - overhead)}
    assert models.payload_bytes(payload) == models.PAYLOAD_MAX_BYTES
    TaskSpec.model_validate(spec_with(payload=payload))
