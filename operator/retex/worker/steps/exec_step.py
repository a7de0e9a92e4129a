"""`exec` steps: a command run without a shell, in its own process group, started by the worker's
tether (`retex.worker.tether`, one per worker: the group dies if the worker does).

Environment: the worker's (minus its credentials and every Secret value), the step's `env` (a
valueFrom.secretKeyRef read from the worker's own env, where the Job put it), then RETEX_IDEMPOTENCY_KEY,
RETEX_TASK_UID, RETEX_STEP, RETEX_ATTEMPT, RETEX_PAYLOAD_FILE and RETEX_RESULTS_FILE (JSON files).
Result: {"exitCode": 0, "stdout": <last 32 KiB>, "stderr": <last 8 KiB>} (+ "...Truncated": true).
Verify convention: exit 0 = found (its output is the result); exit 44 = not found (the verify also
gets it as RETEX_NOT_FOUND_EXIT_CODE); any other exit = the verify could not tell. Not exit 1:
that is what a crashing script exits with (a Python traceback, a `set -e` shell, a missing
variable), and a crash must never be read as "the effect did not happen" — that re-runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from retex.api.models import ExecAction, Step
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
    tail_text,
)
from retex.worker.processes import LEASE_LOST, ProcessEnd, Tether, own_deadline, supervise
from retex.worker.supervision import SecretMissing, StepCall, Supervision, secret_value

STDOUT_TAIL_BYTES = 32 * 1024
STDERR_TAIL_BYTES = 8 * 1024
ERROR_TAIL_BYTES = 1024
VERIFY_NOT_FOUND_EXIT_CODE = 44
TETHER = Tether()  # this worker's: every exec step's group is started by it


def exit_outcome(step: Step, code: int, stderr_tail: str) -> Failed | Unknown:
    """A non-zero exit. Most come after the effect may have happened (a traceback, `set -e`, a
    `curl ... && jq` failing after the POST): for a step that is not idempotent a code is a clean
    failure only if the step names it in retryableExitCodes or permanentExitCodes, else unknown."""
    summary = f"exit code {code}: {stderr_tail}"
    declared = (step.retryable_exit_codes or []) + (step.permanent_exit_codes or [])
    if not step.idempotent and code not in declared:
        return Unknown(f"{summary} (not idempotent, and this exit code is not declared: the effect may have happened)")
    return Failed(summary, retryable=exit_code_retryable(step, code))


def exit_code_retryable(step: Step, code: int) -> bool:
    """By default every non-zero exit is retried; the step's lists narrow that."""
    if step.retryable_exit_codes is not None:
        return code in step.retryable_exit_codes
    if step.permanent_exit_codes is not None:
        return code not in step.permanent_exit_codes
    return True


@dataclass(frozen=True)
class _Ran:
    end: ProcessEnd
    output: dict[str, Any]  # exitCode, stdout, stderr tails
    stderr_tail: str


def _execute(action: ExecAction, step: Step, call: StepCall, sup: Supervision,
             extra_env: dict[str, str] | None = None) -> _Ran | Failed:
    try:
        step_env = {var.name: secret_value(var.value_from.secret_key_ref) if var.value_from else var.value
                    for var in action.env or []}
    except SecretMissing as missing:
        return Failed(str(missing), retryable=False)
    workdir = Path(tempfile.mkdtemp(prefix="retex-step-"))
    try:
        payload_file, results_file = workdir / "payload.json", workdir / "results.json"
        payload_file.write_text(json.dumps(call.payload))
        results_file.write_text(json.dumps(call.results))
        env = {**sup.env, **step_env,
               "RETEX_IDEMPOTENCY_KEY": call.idempotency_key, "RETEX_TASK_UID": call.task_uid,
               "RETEX_STEP": call.step, "RETEX_ATTEMPT": str(call.attempt),
               "RETEX_PAYLOAD_FILE": str(payload_file), "RETEX_RESULTS_FILE": str(results_file),
               **(extra_env or {})}
        with open(workdir / "stdout", "w+b") as stdout, open(workdir / "stderr", "w+b") as stderr:
            started = TETHER.start([*action.command, *(action.args or [])], env=env, stdout=workdir / "stdout",
                                   stderr=workdir / "stderr", deadline=own_deadline(step, call, sup))
            if isinstance(started, str):  # not found, not executable: no retry will change that
                return Failed(started, retryable=False)
            end = started if isinstance(started, ProcessEnd) else supervise(
                started, deadline=call.begun + step.timeout_seconds, drain=sup.drain,
                kill_grace=sup.kill_grace_seconds, held=sup.held)
            out, out_cut = tail_text(_last_bytes(stdout, STDOUT_TAIL_BYTES), STDOUT_TAIL_BYTES)
            err, err_cut = tail_text(_last_bytes(stderr, STDERR_TAIL_BYTES), STDERR_TAIL_BYTES)
        output: dict[str, Any] = {"exitCode": end.returncode, "stdout": out, "stderr": err}
        if out_cut:
            output["stdoutTruncated"] = True
        if err_cut:
            output["stderrTruncated"] = True
        return _Ran(end=end, output=output, stderr_tail=err[-ERROR_TAIL_BYTES:])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _last_bytes(file: BinaryIO, limit: int) -> bytes:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - limit))
    return file.read()


def _exit_code_or_why(end: ProcessEnd, step: Step) -> int | str:
    """The command's exit code, or why it gave no answer of its own (timeout, drain, a signal)."""
    if end.lease_lost:
        return LEASE_LOST
    if end.why is not None:
        return end.why
    if end.timed_out:
        return f"timed out after {step.timeout_seconds}s (process group killed)"
    if end.abandoned:
        return "stopped at the drain deadline"
    if end.returncode is None:  # supervise() marks every end it caused, so not seen
        return "stopped by the worker"
    if end.returncode < 0:
        return f"killed by signal {-end.returncode}"
    return end.returncode


def run(action: ExecAction, step: Step, call: StepCall, sup: Supervision) -> StepOutcome:
    if not sup.held():
        return Abandoned(LEASE_LOST)
    ran = _execute(action, step, call, sup)
    if isinstance(ran, Failed):
        return ran
    code = _exit_code_or_why(ran.end, step)
    if isinstance(code, str):
        return Abandoned(code) if ran.end.abandoned else Unknown(code)
    if code == 0:
        return Succeeded(ran.output)
    return exit_outcome(step, code, ran.stderr_tail)


def verify(action: ExecAction, step: Step, call: StepCall, sup: Supervision) -> VerifyOutcome:
    if not sup.held():
        return Abandoned(LEASE_LOST)
    ran = _execute(action, step, call, sup, {"RETEX_NOT_FOUND_EXIT_CODE": str(VERIFY_NOT_FOUND_EXIT_CODE)})
    if isinstance(ran, Failed):
        return VerifyFailed(ran.error)
    code = _exit_code_or_why(ran.end, step)
    if isinstance(code, str):
        return Abandoned(code) if ran.end.abandoned else VerifyFailed(f"verify {code}")
    if code == 0:
        return Found({**ran.output, "verified": True})
    if code == VERIFY_NOT_FOUND_EXIT_CODE:
        return NotFound()
    return VerifyFailed(f"verify exit code {code}: {ran.stderr_tail}")
