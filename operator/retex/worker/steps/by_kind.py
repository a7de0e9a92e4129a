"""Running a step, or its verify, by kind: the one place that looks at which action a step has."""

from __future__ import annotations

from retex.api.models import Action, Step
from retex.worker.outcomes import StepOutcome, VerifyOutcome
from retex.worker.steps import exec_step, http_step, python_step
from retex.worker.supervision import StepCall, Supervision


def in_flight_seconds(step: Step) -> float:
    """How long after its begin a run of `step` may still land its effect (before the margin): an
    exec or python step is stopped at its timeout (its group leader's own SIGKILL, 3 s later, is
    inside the margin); an http request is sent within `http_step.send_within_seconds` of the
    begin or never, and the server is allowed timeoutSeconds after receiving it."""
    if step.http is not None:
        return http_step.send_within_seconds(step) + step.timeout_seconds
    return float(step.timeout_seconds)


def run_step(step: Step, call: StepCall, sup: Supervision) -> StepOutcome:
    if step.exec is not None:
        return exec_step.run(step.exec, step, call, sup)
    if step.http is not None:
        return http_step.run(step.http, step, call, sup)
    assert step.python is not None  # exactly one kind (Action's validator)
    return python_step.run(step.python, step, call, sup)


def run_verify(verify: Action, step: Step, call: StepCall, sup: Supervision) -> VerifyOutcome:
    if verify.exec is not None:
        return exec_step.verify(verify.exec, step, call, sup)
    if verify.http is not None:
        return http_step.verify(verify.http, step, call, sup)
    assert verify.python is not None  # exactly one kind (Action's validator)
    return python_step.verify(verify.python, step, call, sup)
