"""The worker's ledger operations as JSON (retex.ledger.wire): records and errors survive the trip
unchanged, and what the endpoint may be asked is exactly what a worker calls."""

from __future__ import annotations

import inspect
import json
from datetime import UTC, datetime

import pytest

from retex.ledger import (
    CancelRequested,
    FenceRejected,
    Ledger,
    LedgerUnavailable,
    ResultTooLarge,
    StepNotFound,
    StepOutOfOrder,
    StepRecord,
    TaskNotFound,
    TaskRecord,
    UnstorableValue,
    readers,
    worker_operations,
)
from retex.ledger.wire import OPERATIONS, UNFENCED, error_from_json, error_to_json, task_from_json, to_json
from retex.machine import IllegalTransition, StepState, TaskPhase
from retex.worker.ledger_client import LedgerClient

NOW = datetime(2026, 12, 3, 8, 0, 0, 123456, tzinfo=UTC)


def step(idx: int, state: StepState, result=None) -> StepRecord:
    return StepRecord(idx=idx, name=f"s{idx}", state=state, attempt=2 if state != StepState.PENDING else None,
                      idempotency_key=f"u:s{idx}:abcd", result=result, error=None,
                      started_at=NOW if state != StepState.PENDING else None, finished_at=None)


RECORD = TaskRecord(
    uid="u", namespace="shop", name="order", spec={"steps": [{"name": "s0"}], "payload": {"ü": [1.5, None]}},
    spec_hash="h", phase=TaskPhase.RUNNING, reason=None, dead_lettered=False, epoch=2, failures=1, disruptions=0,
    max_attempts=3, max_disruptions=10, not_before=None, concurrency_key="k", priority=5, deadline_at=NOW,
    cancel_requested=False, last_error="boom", version=7, created_at=NOW, updated_at=NOW, started_at=NOW,
    finished_at=None, steps=(step(0, StepState.DONE, {"id": "r-1", "n": [1, 2]}), step(1, StepState.STARTED),
                             step(2, StepState.PENDING)))


def test_a_task_record_round_trips_through_json_unchanged():
    assert task_from_json(json.loads(json.dumps(to_json(RECORD)))) == RECORD


@pytest.mark.parametrize("error", [
    FenceRejected("u", 1, 2, "Running"), TaskNotFound("u"), CancelRequested("u"), StepOutOfOrder("step 2 first"),
    ResultTooLarge("too big"), UnstorableValue("NUL"), LedgerUnavailable("down"),
    IllegalTransition("step", "not started by this attempt", "start a run of step 0"),
])
def test_every_error_a_worker_branches_on_comes_back_as_its_own_type_and_message(error):
    back = error_from_json(json.loads(json.dumps(error_to_json(error))))
    assert type(back) is type(error) and str(back) == str(error)
    if isinstance(error, FenceRejected):
        assert (back.uid, back.epoch, back.current_epoch, back.phase) == ("u", 1, 2, "Running")


def test_a_missing_step_crosses_the_wire_as_the_illegal_transition_workers_already_know():
    # Workers of an older release know no StepNotFound; to them it was always an IllegalTransition.
    missing = StepNotFound("u", 3, "begin")
    sent = error_to_json(missing)
    assert sent["error"] == "IllegalTransition"
    back = error_from_json(json.loads(json.dumps(sent)))
    assert type(back) is IllegalTransition and str(back) == str(missing) == "illegal step transition: 'begin of step 3' from 'missing'"


def test_the_endpoint_offers_exactly_the_operations_the_worker_client_has_with_the_ledgers_arguments():
    client_ops = {name for name, _ in inspect.getmembers(LedgerClient, inspect.isfunction) if not name.startswith("_")}
    assert set(OPERATIONS) == client_ops - {"close"}
    for operation, arguments in OPERATIONS.items():
        params = inspect.signature(getattr(Ledger, operation)).parameters
        fixed = ["self", "uid"] if operation in UNFENCED else ["self", "uid", "epoch"]
        server_supplied = {"pod"} if operation == "claim_attempt" else ({"actor"} if operation not in UNFENCED else set())
        assert list(params)[:len(fixed)] == fixed, operation
        assert set(params) - set(fixed) - {"rng"} == set(arguments) | server_supplied, operation


def test_every_operation_a_worker_may_name_is_one_function_of_worker_operations_or_the_reader_get():
    # The one home of the worker's operations (retex.ledger.worker_operations); the Ledger method
    # the endpoint runs takes the same arguments as the function, less the cursor.
    homes = {name: readers if name == "get" else worker_operations for name in OPERATIONS}
    defined_there = {name for name, fn in inspect.getmembers(worker_operations, inspect.isfunction)
                     if fn.__module__ == worker_operations.__name__ and "cur" in inspect.signature(fn).parameters}
    assert set(OPERATIONS) - {"get"} == defined_there
    for operation, home in homes.items():
        params = list(inspect.signature(getattr(home, operation)).parameters)
        assert params[0] == "cur", operation
        assert params[1:] == list(inspect.signature(getattr(Ledger, operation)).parameters)[1:], operation
