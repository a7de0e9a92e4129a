"""Typed errors of the ledger. Callers branch on the type, never on message text."""

from __future__ import annotations

from datetime import UTC, datetime

from retex.machine import IllegalTransition


class LedgerError(Exception):
    """Base of every error the ledger raises on purpose."""


class TaskNotFound(LedgerError):
    def __init__(self, uid: str):
        super().__init__(f"no task {uid!r} in the ledger")
        self.uid = uid


class FenceRejected(LedgerError):
    """A worker wrote with an epoch that is not current, or to a task that is not Running.

    The worker must stop at once: another attempt owns the task, or the task is over.
    """

    def __init__(self, uid: str, epoch: int, current_epoch: int, phase: str):
        super().__init__(
            f"fenced: task {uid} is at epoch {current_epoch} ({phase}); write from epoch {epoch} rejected"
        )
        self.uid, self.epoch, self.current_epoch, self.phase = uid, epoch, current_epoch, phase


class CancelRequested(LedgerError):
    """The task was asked to cancel; the worker must stop at this step boundary."""

    def __init__(self, uid: str):
        super().__init__(f"task {uid} is being cancelled")
        self.uid = uid


class StepNotFound(IllegalTransition):
    """The task has no step of that index or name. An IllegalTransition (from the state "missing"),
    and so named on the worker's wire (retex.ledger.wire), as it was before it had a type of its own."""

    def __init__(self, uid: str, step: int | str, event: str):
        super().__init__("step", "missing", f"{event} of step {step!r}")
        self.uid, self.step = uid, step


class StepOutOfOrder(LedgerError):
    """A step may only begin when every step before it is done (the contiguous-prefix rule)."""


class StepInFlight(LedgerError):
    """A re-run of a step asked while its latest run may still land its effect (before the
    step's deadline, as the worker reckons it before verifying or re-running a started step):
    sent again then, the effect could happen twice. `rerun_from`: when it may be asked (the
    database's clock); `seconds_left`: how long until then, as the ledger measured it."""

    def __init__(self, uid: str, step: str, *, rerun_from: datetime, seconds_left: float):
        self.why = (f"its latest run may still land its effect until {rerun_from.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ} "
                    f"({seconds_left:.0f}s from now): ask for the re-run after that, or mark it done if the effect "
                    "happened")
        super().__init__(f"step {step!r} of task {uid}: {self.why}")
        self.uid, self.step, self.rerun_from, self.seconds_left = uid, step, rerun_from, seconds_left


class ResultTooLarge(LedgerError):
    """A step result above the size limit; large data belongs in external storage, by reference."""


class UnstorableValue(LedgerError):
    """Postgres refused a step's result or error text (a NUL, a NaN, an invalid escape): the
    write did not happen; the caller decides what to store instead."""


class NotLeader(LedgerError):
    """A leader's write refused, nothing of it written: its term is no longer the ledger's (a
    successor took a newer one, or the server ended the transaction after it sat idle past the
    session's limit, as a frozen leader's does) or it never took one. The caller stops writing as
    the leader; it is nobody's task failure. `term`: the term the refused writer wrote with (None:
    it had taken none), so a replica that has taken a newer one since can tell an old refusal."""

    def __init__(self, why: str, *, term: int | None = None):
        super().__init__(f"not the leader: {why}")
        self.term = term


class LedgerUnavailable(LedgerError):
    """Postgres stayed unreachable for longer than the retry window."""


class NotFrozen(LedgerError):
    """A recovery asked for a task that is not frozen: there is nothing to recover."""


class InstallMismatch(LedgerError):
    """This ledger belongs to another install of retex (another namespace or cluster)."""

    def __init__(self, owner_uid: str, owner_namespace: str, uid: str, namespace: str):
        same_namespace = owner_namespace == namespace
        super().__init__(
            f"this ledger belongs to the retex install {owner_uid} (operator namespace {owner_namespace!r}); "
            f"this operator is install {uid} (namespace {namespace!r}). "
            + ("The namespaces match: the Lease retex-install that keeps the install's uid was probably deleted "
               f"(or the namespace recreated). Put the owner's uid back on it (annotation retex.dev/install-uid="
               f"{owner_uid}), or start this install once with RETEX_ADOPT_LEDGER={owner_uid}"
               if same_namespace else
               "Two installs must not share one ledger: point this one at a database of its own. If this "
               "install replaces that one (retex reinstalled, its namespace recreated), start it once with "
               f"RETEX_ADOPT_LEDGER={owner_uid}"))
        self.owner_uid, self.owner_namespace = owner_uid, owner_namespace
