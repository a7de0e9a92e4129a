"""Running a step, or its verify, by kind: the one place that looks at which action a step has."""

from __future__ import annotations

from retex.api.models import Action, Step
from retex.worker import exec_step, http_step, python_step
from retex.worker.calls import StepCall, Supervision
from retex.worker.outcomes import StepOutcome, VerifyOutcome


def run_step(step: Step, call: StepCall, sup: Supervision) -> StepOutcome:
    if step.exec is not None:
        return exec_step.run(step.exec, step, call, sup)
    if step.http is not None:
        return http_step.run(step.http, step, call, sup)
    return python_step.run(step.python, step, call, sup)


def run_verify(verify: Action, step: Step, call: StepCall, sup: Supervision) -> VerifyOutcome:
    if verify.exec is not None:
        return exec_step.verify(verify.exec, step, call, sup)
    if verify.http is not None:
        return http_step.verify(verify.http, step, call, sup)
    return python_step.verify(verify.python, step, call, sup)
