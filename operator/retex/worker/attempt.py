"""One attempt's run through the steps: begin (fenced) → run → record (fenced), one step at a time,
from the contiguous completed prefix. Knows nothing of Kubernetes: liveness comes in as
`HeldLease`, so this loop can be driven against a real ledger without a cluster.

Where an outcome is unknown — a step begun by an earlier process and never recorded (crash-matrix
R6), or a run that timed out, lost its connection or gave an answer that does not prove nothing
happened — it is resolved without guessing: the step's verify if it has one (only once the step's
deadline has passed, so a run still in flight cannot land after it), else a re-run (now or on
retry) if it is idempotent, else NeedsAttention. A lost lease kills the running step and records
nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from retex.api.models import Action, Step, TaskSpec
from retex.failpoints import failpoint
from retex.ledger import (
    CancelRequested,
    FenceRejected,
    LedgerUnavailable,
    StepRecord,
    TaskRecord,
    UnstorableValue,
)
from retex.logs import log_line
from retex.machine import StepState
from retex.worker.ledger_client import LedgerClient
from retex.worker.logs import TaskFields
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
    stored_result,
    stored_text,
)
from retex.worker.steps.by_kind import in_flight_seconds, run_step, run_verify
from retex.worker.supervision import StepCall, Supervision

if TYPE_CHECKING:
    from retex.ledger import Ledger  # the store: a type only, the worker never imports psycopg

log = logging.getLogger(__name__)

# How long past a step's begin + its in-flight time (by_kind.in_flight_seconds) a verify waits while
# the step may still be in flight: covers the step's own kill (its group leader's SIGKILL at
# begin + timeout + grace + 1 s, processes.own_deadline), a late timer on a loaded host and clock
# rate differences. The begin is read before the write that stores started_at (StepCall.begun).
DEADLINE_MARGIN_SECONDS = 5.0
_DEADLINE_POLL_SECONDS = 1.0
# A begin that took longer than this (retried through an operator restart) has spent part of the
# step's timeout before anything ran: the run's start is recorded again (start_run).
SLOW_BEGIN_SECONDS = 1.0


class ExitCode(enum.IntEnum):
    OVER = 0  # this attempt is over and the ledger says why
    STALE = 3  # not ours: fenced, epoch not current, task terminal, lease held by another
    DISRUPTED = 75  # drained, lease lost or missing, ledger unavailable: not the task's failure


@dataclass(frozen=True)
class AttemptEnd:
    code: ExitCode
    why: str


class HeldLease(Protocol):
    def still_held(self) -> bool: ...


@dataclass(frozen=True)
class _Committed:
    result: Any


_RUN_IT = None  # an interrupted step that must simply run


class Attempt:
    def __init__(self, ledger: Ledger | LedgerClient, record: TaskRecord, *, epoch: int, actor: str, lease: HeldLease,
                 supervision: Supervision, tagger: TaskFields | None = None, verify_tries: int = 3,
                 verify_retry_seconds: float = 1.0):
        self._ledger, self._record, self._epoch, self._actor = ledger, record, epoch, actor
        # The step runners kill a running step the moment the lease can no longer be shown held.
        self._lease, self._sup, self._tagger = lease, dataclasses.replace(supervision, held=lease.still_held), tagger
        self._verify_tries, self._verify_retry_seconds = verify_tries, verify_retry_seconds

    def run(self) -> AttemptEnd:
        try:
            return self._run()
        except FenceRejected as exc:
            log_line(log, logging.WARNING, "fenced: stopping at once", current_epoch=exc.current_epoch, phase=exc.phase)
            return AttemptEnd(ExitCode.STALE, str(exc))
        except LedgerUnavailable as exc:
            log_line(log, logging.ERROR, "ledger unavailable", error=str(exc))
            return AttemptEnd(ExitCode.DISRUPTED, str(exc))

    def _run(self) -> AttemptEnd:
        try:
            spec = TaskSpec.model_validate(self._record.spec)
        except ValidationError as exc:
            return self._refuse_spec(exc)
        uid = self._record.uid
        results = {s.name: s.result for s in self._record.steps[: self._record.completed_steps]}
        for idx in range(self._record.completed_steps, len(spec.steps)):
            step = spec.steps[idx]
            self._tag(step.name)
            if self._sup.drain.requested.is_set():
                return AttemptEnd(ExitCode.DISRUPTED, "drained: no new step started")
            if not self._lease.still_held():
                return AttemptEnd(ExitCode.DISRUPTED, "lease lost: no new step started")
            failpoint("before-step", step.name, task=self._record.name, uid=uid)
            # Read before the write that records the begin (so never later than its started_at):
            # the step's own deadlines count from here (StepCall.begun).
            begun = time.monotonic()
            try:
                prior = self._ledger.begin_step(uid, self._epoch, idx, actor=self._actor)
            except CancelRequested:
                self._ledger.finish_cancelled(uid, self._epoch, actor=self._actor)
                log_line(log, logging.INFO, "cancelled at a step boundary")
                return AttemptEnd(ExitCode.OVER, "cancelled")
            failpoint("after-begin", step.name, task=self._record.name, uid=uid)
            call = StepCall(task_uid=uid, step=step.name, idempotency_key=prior.idempotency_key,
                            attempt=self._epoch, payload=spec.payload or {}, results=dict(results), begun=begun)
            ended = _RUN_IT
            if prior.state == StepState.STARTED:
                ended = self._resolve_interrupted(idx, step, call, prior)
            if ended is _RUN_IT and (prior.state == StepState.STARTED
                                     or time.monotonic() - begun > SLOW_BEGIN_SECONDS):
                # Recorded before it runs (fenced): a later attempt waits out this run, which may
                # start long after the begin was stored (after waiting and verifying, or after
                # retrying a begin whose reply was lost), and the run gets its whole timeout.
                call = dataclasses.replace(call, begun=time.monotonic())
                self._ledger.start_run(uid, self._epoch, idx, actor=self._actor)
            if ended is _RUN_IT:
                log_line(log, logging.INFO, "step running", idempotency_key=call.idempotency_key)
                outcome = self._run_step(step, call)
                failpoint("after-effect", step.name, task=self._record.name, uid=uid)
                ended = self._record_outcome(idx, step, call, outcome)
            if isinstance(ended, AttemptEnd):
                return ended
            failpoint("after-commit", step.name, task=self._record.name, uid=uid)
            results[step.name] = ended.result
        self._tag(None)
        failpoint("before-complete", task=self._record.name, uid=uid)
        self._ledger.complete_task(uid, self._epoch, actor=self._actor)
        log_line(log, logging.INFO, "task succeeded")
        return AttemptEnd(ExitCode.OVER, "succeeded")

    def _refuse_spec(self, exc: ValidationError) -> AttemptEnd:
        """A spec this worker's models refuse (admitted before a rule that now refuses it): no
        retry can change that. The task ends through the fenced path at its first step not done,
        nothing run: a permanent failure, or NeedsAttention if that step was begun and never
        recorded (its effect may have happened)."""
        problems = "; ".join(f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
                             for error in exc.errors()[:5])
        why = f"the task's spec is refused by this worker (admitted before a rule that now refuses it): {problems}"
        log_line(log, logging.ERROR, "spec refused", error=why)
        idx = self._record.completed_steps
        if idx == len(self._record.steps):  # every effect is done and recorded: nothing to refuse
            self._ledger.complete_task(self._record.uid, self._epoch, actor=self._actor)
            return AttemptEnd(ExitCode.OVER, "succeeded")
        self._tag(self._record.steps[idx].name)
        try:
            prior = self._ledger.begin_step(self._record.uid, self._epoch, idx, actor=self._actor)
        except CancelRequested:
            self._ledger.finish_cancelled(self._record.uid, self._epoch, actor=self._actor)
            return AttemptEnd(ExitCode.OVER, "cancelled")
        if prior.state == StepState.STARTED:
            return self._flag(idx, f"{why}; and the step was begun by attempt {prior.attempt} and never recorded")
        return self._fail(idx, why, retryable=False)

    # -- outcomes ----------------------------------------------------------------------------

    def _record_outcome(self, idx: int, step: Step, call: StepCall, outcome: StepOutcome) -> _Committed | AttemptEnd:
        match outcome:
            case Succeeded(result):
                return self._commit(idx, result, "step committed")
            case Failed(error, retryable):
                return self._fail(idx, error, retryable=retryable)
            case Unknown(why):
                return self._settle_unknown(idx, step, call, why)
            case Abandoned(why):
                log_line(log, logging.WARNING, "step abandoned; nothing recorded", why=why)
                return AttemptEnd(ExitCode.DISRUPTED, f"step abandoned, nothing recorded: {why}")
        raise AssertionError(outcome)

    def _resolve_interrupted(self, idx: int, step: Step, call: StepCall, prior: StepRecord) -> _Committed | AttemptEnd | None:
        """R6: begun by attempt `prior.attempt`, never recorded. Did its effect happen?"""
        log_line(log, logging.WARNING, "step was begun and never recorded", begun_by_attempt=prior.attempt,
                 has_verify=step.verify is not None, idempotent=step.idempotent)
        if step.verify is not None:
            if (end := self._await_step_deadline(idx, step, begun_at=prior.started_at)) is not None:
                return end
            match self._verify(step.verify, step, call):
                case Found(result):
                    return self._commit(idx, result, "verify found the effect: committed without running")
                case NotFound():
                    log_line(log, logging.INFO, "verify found no effect: running the step")
                    return _RUN_IT
                case VerifyFailed(error):
                    return self._flag(idx, f"step was interrupted and its verify could not tell: {error}")
                case Abandoned(why):
                    return AttemptEnd(ExitCode.DISRUPTED, f"verify abandoned: {why}")
        if step.idempotent:
            log_line(log, logging.INFO, "idempotent: running it again with the same key")
            return _RUN_IT
        return self._flag(idx, f"step was begun by attempt {prior.attempt} and never recorded; it has no verify "
                               "and is not idempotent, so whether its effect happened is unknown")

    def _settle_unknown(self, idx: int, step: Step, call: StepCall, why: str) -> _Committed | AttemptEnd:
        """The run gave no answer: the same question as R6, asked now."""
        log_line(log, logging.WARNING, "step outcome unknown", why=why)
        if step.verify is not None:
            # The step stays `started` until its deadline: a server may still be processing it.
            if (end := self._await_step_deadline(idx, step, run_started=call.begun)) is not None:
                return end
            match self._verify(step.verify, step, call):
                case Found(result):
                    return self._commit(idx, result, "verify found the effect: committed")
                case NotFound():
                    return self._fail(idx, f"{why}; verify found no effect", retryable=True)
                case VerifyFailed(error):
                    return self._flag(idx, f"{why}; verify could not tell: {error}")
                case Abandoned(reason):
                    return AttemptEnd(ExitCode.DISRUPTED, f"verify abandoned: {reason}")
        if step.idempotent:
            return self._fail(idx, why, retryable=True)
        return self._flag(idx, f"{why}; the step has no verify and is not idempotent, so whether its effect "
                               "happened is unknown")

    def _await_step_deadline(self, idx: int, step: Step, *, begun_at: datetime | None = None,
                             run_started: float | None = None) -> AttemptEnd | None:
        """Wait until the step's begin + its in-flight time (timeoutSeconds; for http the send
        window + timeoutSeconds) + margin has passed: before that, a run of it
        may still land its effect, and a verify would find nothing and run it a second time. Another
        process's begin (`begun_at`, as begin_step returned it) is judged by the database's clock;
        this worker's own run by its own monotonic clock from `run_started` (it may have started
        long after the begin recorded in the ledger). Honours the drain and the lease meanwhile (the
        renewer goes on in the background)."""
        after = in_flight_seconds(step) + DEADLINE_MARGIN_SECONDS

        def seconds_left() -> float:
            if run_started is not None:
                return run_started + after - time.monotonic()
            return self._ledger.seconds_until_step_deadline(self._record.uid, idx, begun_at=begun_at,
                                                            after_seconds=after)

        announced = False
        while (left := seconds_left()) > 0:
            if not announced:
                log_line(log, logging.INFO, "waiting for the step's deadline before verifying", seconds=round(left, 1))
                announced = True
            if self._sup.drain.requested.wait(min(left, _DEADLINE_POLL_SECONDS)):
                return AttemptEnd(ExitCode.DISRUPTED, "drained while waiting for the step's deadline; nothing recorded")
            if not self._lease.still_held():
                return AttemptEnd(ExitCode.DISRUPTED, "lease lost while waiting for the step's deadline; nothing recorded")
        return None

    def _run_step(self, step: Step, call: StepCall) -> StepOutcome:
        """A runner that raises has lost track of the step, which may have been sent: unknown, with
        the real reason, never a crash after the step began."""
        try:
            return run_step(step, call, self._sup)
        except Exception as exc:  # noqa: BLE001 - recorded through the unknown-outcome rules
            log_line(log, logging.ERROR, "step runner failed", exc_info=True)
            return Unknown(f"the worker failed while running the step: {type(exc).__name__}: {exc}")

    def _verify(self, verify: Action, step: Step, call: StepCall) -> VerifyOutcome:
        """Verify is read-only, so an error is retried a few times before a human is asked."""
        outcome: VerifyOutcome = VerifyFailed("not run")
        for attempt in range(1, self._verify_tries + 1):
            try:
                # A verify's own time counts from its own start, not from the step's begin.
                outcome = run_verify(verify, step, dataclasses.replace(call, begun=time.monotonic()), self._sup)
            except Exception as exc:  # noqa: BLE001 - a verify that cannot run cannot tell
                log_line(log, logging.ERROR, "verify runner failed", exc_info=True)
                outcome = VerifyFailed(f"the worker failed while verifying: {type(exc).__name__}: {exc}")
            log_line(log, logging.INFO, "verify ran", outcome=type(outcome).__name__, try_number=attempt)
            if not isinstance(outcome, VerifyFailed) or self._sup.drain.requested.is_set():
                return outcome
            if attempt < self._verify_tries:
                time.sleep(self._verify_retry_seconds)
        return outcome

    # -- ledger writes -----------------------------------------------------------------------

    def _commit(self, idx: int, result: Any, message: str) -> _Committed:
        result = stored_result(result)
        try:
            self._ledger.commit_step(self._record.uid, self._epoch, idx, result, actor=self._actor)
        except UnstorableValue as exc:
            # The effect happened: a result the ledger will not take must not make the step run again.
            result = {"sanitized": True, "refused": stored_text(str(exc))[:1024]}
            self._ledger.commit_step(self._record.uid, self._epoch, idx, result, actor=self._actor)
        log_line(log, logging.INFO, message)
        return _Committed(result)

    def _fail(self, idx: int, error: str, *, retryable: bool) -> AttemptEnd:
        error = stored_text(error)
        record = self._ledger.fail_step(self._record.uid, self._epoch, idx, error, retryable=retryable,
                                        actor=self._actor)
        log_line(log, logging.WARNING, "step failed", error=error, retryable=retryable, phase=str(record.phase))
        return AttemptEnd(ExitCode.OVER, f"step failed ({'retryable' if retryable else 'permanent'}): task {record.phase}")

    def _flag(self, idx: int, why: str) -> AttemptEnd:
        why = stored_text(why)
        self._ledger.flag_step(self._record.uid, self._epoch, idx, why, actor=self._actor)
        log_line(log, logging.ERROR, "needs attention", why=why)
        return AttemptEnd(ExitCode.OVER, f"needs attention: {why}")

    def _tag(self, step: str | None) -> None:
        if self._tagger is not None:
            self._tagger.step = step
