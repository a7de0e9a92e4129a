"""A human's re-run of a flagged step waits for the same deadline the worker waits for before it
verifies or re-runs a started step: the ledger reads it from the spec as stored (no models), the
worker from its models; the two must agree for every kind of step."""

import pytest

from retex.api import TaskSpec
from retex.ledger.operator_operations import rerun_after_seconds
from retex.worker.attempt import DEADLINE_MARGIN_SECONDS
from retex.worker.steps.by_kind import in_flight_seconds

KINDS = {
    "exec": {"exec": {"command": ["true"]}},
    "http": {"http": {"method": "POST", "url": "https://pay.example/charge"}},
    "python": {"python": {"callable": "shop.payments:charge"}},
}


@pytest.mark.parametrize("timeout", [None, 1, 7, 10, 11, 300, 86400])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_ledger_waits_for_a_steps_run_as_long_as_the_worker_does(kind, timeout):
    step = {"name": "charge", **KINDS[kind], **({"timeoutSeconds": timeout} if timeout else {})}
    spec = TaskSpec.model_validate({"steps": [step]})
    stored = spec.as_admitted()["steps"][0]  # what the ledger holds
    worker_waits = in_flight_seconds(spec.steps[0]) + DEADLINE_MARGIN_SECONDS
    assert rerun_after_seconds(stored) == worker_waits
    assert rerun_after_seconds(step) == worker_waits  # a spec naming no timeoutSeconds: the models' default
