"""`python` steps: `module:function` from the worker image, called as `function(context, **args)`
in a child interpreter (see `pycall`) with a `StepContext`.

Outcomes: a return value = success (the result, JSON; other values are stored as their repr);
`PermanentError` = permanent failure; `RetryableError` = retryable failure (both declare that the
effect did not happen); any other exception = retryable failure if the step is idempotent, else
unknown (it may have raised after its effect); killed, crashed or timed out without answering =
unknown.
Verify convention: returns a result = found (that is the result); returns None = not found;
raises = error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from retex.api.models import PythonAction, Step
from retex.worker.outcomes import (
    Abandoned,
    Failed,
    Found,
    NotFound,
    StepOutcome,
    Succeeded,
    Unknown,
    VerifyFailed,
    VerifyOutcome,
)
from retex.worker.processes import LEASE_LOST, ProcessEnd, own_deadline, supervise
from retex.worker.supervision import StepCall, Supervision


def _call(action: PythonAction, step: Step, call: StepCall, sup: Supervision) -> tuple[ProcessEnd, dict[str, Any] | None]:
    workdir = Path(tempfile.mkdtemp(prefix="retex-step-"))
    try:
        request, response = workdir / "request.json", workdir / "response.json"
        request.write_text(json.dumps({
            "callable": action.callable, "args": action.args or {}, "idempotencyKey": call.idempotency_key,
            "taskUid": call.task_uid, "step": call.step, "attempt": call.attempt, "payload": call.payload,
            "results": call.results, "workerPid": os.getpid(), "deadline": own_deadline(step, call, sup),
        }))
        # -P and cwd /: nothing an earlier step wrote where the worker runs can shadow a module.
        proc = subprocess.Popen([sys.executable, "-P", "-m", "retex.worker.steps.pycall", str(request), str(response)],
                                env=dict(sup.env), stdin=subprocess.DEVNULL, start_new_session=True, cwd="/")
        end = supervise(proc, deadline=call.begun + step.timeout_seconds, drain=sup.drain, kill_grace=sup.kill_grace_seconds,
                        held=sup.held)
        answer = json.loads(response.read_text()) if response.exists() else None
        return end, answer
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _unanswered(end: ProcessEnd, step: Step) -> str:
    if end.lease_lost:
        return LEASE_LOST
    if end.timed_out:
        return f"timed out after {step.timeout_seconds}s (process killed)"
    return f"the call ended without answering (exit code {end.returncode})"


def run(action: PythonAction, step: Step, call: StepCall, sup: Supervision) -> StepOutcome:
    if not sup.held():
        return Abandoned(LEASE_LOST)
    end, answer = _call(action, step, call, sup)
    if end.lease_lost:
        return Abandoned(LEASE_LOST)
    if end.abandoned and (answer is None or answer["outcome"] != "ok"):
        # A failure it raised because the drain cancelled it is not the step's failure.
        return Abandoned("stopped at the drain deadline")
    if answer is None:
        return Unknown(_unanswered(end, step))
    if answer["outcome"] == "ok":
        return Succeeded(answer["result"])
    if answer["outcome"] == "unexpected" and not step.idempotent:
        return Unknown(f"raised an undeclared exception (not idempotent, so the effect may have happened): "
                       f"{answer['error']}")
    return Failed(answer["error"], retryable=answer["outcome"] != "permanent")


def verify(action: PythonAction, step: Step, call: StepCall, sup: Supervision) -> VerifyOutcome:
    if not sup.held():
        return Abandoned(LEASE_LOST)
    end, answer = _call(action, step, call, sup)
    if end.lease_lost:
        return Abandoned(LEASE_LOST)
    if end.abandoned and answer is None:
        return Abandoned("stopped at the drain deadline")
    if answer is None:
        return VerifyFailed(f"verify: {_unanswered(end, step)}")
    if answer["outcome"] != "ok":
        return VerifyFailed(f"verify: {answer['error']}")
    if answer["result"] is None:
        return NotFound()
    return Found(answer["result"])
