"""The message of an InvalidSpec refusal: retex's own words, each problem as field path + what is
wrong, in the API server's path form; never pydantic's error dump (input values, its URLs)."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from retex.api import TaskSpec, models
from retex.operator.admission import invalid_spec_message
from tests.unit.test_api_refusals import EXEC, REFUSALS, spec_with, step


def message_for(spec) -> str:
    with pytest.raises(ValidationError) as refused:
        TaskSpec.model_validate(spec)
    return invalid_spec_message(refused.value)


def test_an_oversized_payload_is_named_by_its_path_with_the_limit_and_without_the_payload():
    payload = {"blob": "x" * models.PAYLOAD_MAX_BYTES}
    assert message_for(spec_with(payload=payload)) == f"spec.payload: {models.MSG_PAYLOAD_TOO_LARGE}"


def test_every_problem_is_listed_by_its_path_in_the_api_servers_form():
    spec = spec_with(step("Bad_Name"), retry={"maxAttempts": 0})
    assert message_for(spec) == (
        "spec.steps[0].name: String should match pattern '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'; "
        "spec.retry.maxAttempts: Input should be greater than or equal to 1")


def test_a_rule_of_a_step_is_its_message_at_the_step():
    assert message_for(spec_with(step(exec=EXEC, http={"method": "GET", "url": "https://a.example"}))) == (
        f"spec.steps[0]: {models.MSG_ONE_KIND}")


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda refusal: refusal.id)
def test_no_refusal_carries_pydantic_text(refusal):
    message = message_for(copy.deepcopy(refusal.spec))
    assert message.startswith("spec")
    for pydantic_text in ("pydantic", "http://", "https://errors", "[type=", "input_value", "Value error,",
                          "validation error for"):
        assert pydantic_text not in message, message
