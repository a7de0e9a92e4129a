"""python steps, run in a real child interpreter: context, error classification, timeouts,
cancellation and the verify convention."""

import time
from pathlib import Path

from retex.worker.outcomes import Abandoned, Failed, Found, NotFound, Succeeded, Unknown, VerifyFailed
from retex.worker.steps import python_step
from retex.worker.supervision import step_environment
from tests.unit.worker_steps_helpers import call, drain_after, step, supervision

REPO = str(Path(__file__).resolve().parents[2])
MODULE = "tests.unit.worker_callables"


def sup(drain_seconds=30.0):
    return supervision(drain_seconds, env={**step_environment(), "PYTHONPATH": REPO})


def run(function, args=None, supervision_=None, **step_fields):
    s = step(python={"callable": f"{MODULE}:{function}", **({"args": args} if args else {})}, **step_fields)
    return python_step.run(s.python, s, call(), supervision_ or sup())


def verify(function):
    s = step(python={"callable": f"{MODULE}:charge"}, verify={"python": {"callable": f"{MODULE}:{function}"}})
    return python_step.verify(s.verify.python, s, call(), sup())


def test_the_function_gets_the_context_and_its_args_and_its_return_is_the_result():
    assert run("charge", {"amount": 42}) == Succeeded({
        "key": "uid-1:charge:abcd1234", "task": "uid-1", "step": "charge", "attempt": 2, "amount": 42,
        "payload": {"amount": 42}, "results": {"reserve": {"id": "r-1"}}})


def test_permanent_error_fails_permanently():
    assert run("declined") == Failed("PermanentError: card declined", retryable=False)


def test_retryable_error_is_retryable_and_so_is_an_unexpected_exception_of_an_idempotent_step():
    busy, broken = run("busy"), run("broken", idempotent=True)
    assert isinstance(busy, Failed) and busy.retryable and "gateway busy" in busy.error
    assert isinstance(broken, Failed) and broken.retryable and "KeyError" in broken.error


def test_an_unexpected_exception_of_a_step_that_is_not_idempotent_is_unknown():
    # It may have been raised after the effect: retrying it blindly could charge twice.
    outcome = run("broken")
    assert isinstance(outcome, Unknown) and "KeyError" in outcome.error


def test_a_function_that_cannot_be_imported_fails_permanently():
    s = step(python={"callable": "no_such_module.here:fn"})
    outcome = python_step.run(s.python, s, call(), sup())
    assert isinstance(outcome, Failed) and not outcome.retryable and "cannot import" in outcome.error


def test_a_target_that_is_not_callable_fails_permanently_without_being_called():
    # Nothing ran, and no retry will change what the image holds: not an Unknown outcome.
    outcome = run("RATE")
    assert isinstance(outcome, Failed) and not outcome.retryable, outcome
    assert "is not callable" in outcome.error, outcome


def test_a_result_that_is_not_json_is_kept_as_its_repr():
    outcome = run("not_json")
    assert isinstance(outcome, Succeeded) and outcome.result == {"tags": "{'a'}"}


def test_an_interpreter_that_dies_without_answering_is_an_unknown_outcome():
    assert isinstance(run("crash"), Unknown)


def test_timeout_kills_the_call_and_the_outcome_is_unknown():
    started = time.monotonic()
    outcome = run("hang", timeoutSeconds=1)
    assert isinstance(outcome, Unknown) and "timed out" in outcome.error
    assert time.monotonic() - started < 4


def test_timeout_sets_the_cancelled_event_so_cooperative_code_can_stop_cleanly():
    assert run("stop_when_cancelled", timeoutSeconds=1) == Succeeded({"cancelled": True})


def test_drain_deadline_abandons_the_call_and_a_failure_it_caused_is_not_recorded():
    for function in ("hang", "give_up_when_cancelled"):
        supervision_ = sup(drain_seconds=0.3)
        drain_after(supervision_, 0.1)
        assert isinstance(run(function, supervision_=supervision_), Abandoned)


def test_verify_returning_a_value_is_found_and_none_is_not_found():
    assert verify("found") == Found({"found": "uid-1:charge:abcd1234"})
    assert verify("not_found") == NotFound()
    assert isinstance(verify("busy"), VerifyFailed)


def test_a_package_left_in_the_working_directory_cannot_shadow_the_step_interpreter(tmp_path, monkeypatch):
    # An earlier step may write files where the worker runs: a `retex/` there must not be imported
    # in place of the worker's own package (python -P, and the child runs in /).
    (tmp_path / "retex").mkdir()
    (tmp_path / "retex" / "__init__.py").write_text("raise SystemExit(97)\n")
    monkeypatch.chdir(tmp_path)
    assert run("charge", {"amount": 1}) == Succeeded({
        "key": "uid-1:charge:abcd1234", "task": "uid-1", "step": "charge", "attempt": 2, "amount": 1,
        "payload": {"amount": 42}, "results": {"reserve": {"id": "r-1"}}})
