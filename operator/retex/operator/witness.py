"""The Task as the ledger's witness, on the operator's side: how a Task's status is read as
evidence of what the ledger once held, and what a frozen task's status shows. Pure: no I/O.

A Task whose status shows a ledgerVersion the ledger has not reached, or shows it was admitted
while the ledger holds nothing of it, is frozen (retex.ledger.witness) by whichever part of the
operator meets it first: admission (kopf's resume at every start), the status resync (at every
leadership's start, before any writer runs, and every resync period after), the status mirror."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from retex.api import LEDGER_BEHIND, ConditionType, ShownPhase, TaskStatus, set_condition
from retex.ledger import TaskRecord


def shown_version(task: dict[str, Any]) -> int | None:
    """The ledgerVersion the Task's status shows: proof that the ledger held the task at that
    version (the status mirror writes only what the ledger committed). None: it shows none."""
    version = (task.get("status") or {}).get("ledgerVersion")
    return version if isinstance(version, int) else None


def behind(task: dict[str, Any], ledger_version: int | None) -> bool:
    """The ledger holds less of the task than its Task showed: an older version of it, or
    (`ledger_version` None) nothing at all though the Task showed a version."""
    shown = shown_version(task)
    return shown is not None and (ledger_version is None or shown > ledger_version)


def frozen_status(record: TaskRecord, *, generation: int | None, now: datetime) -> TaskStatus:
    """A frozen task's status: what its Task showed when it was frozen (its steps, attempts and
    conditions: a task shown Succeeded still meets `kubectl wait --for=condition=Succeeded`),
    phase LedgerBehind, and a LedgerBehind condition saying why and what to do."""
    shown = TaskStatus.model_validate(record.witness or {})
    was = shown.phase if shown.phase not in (None, ShownPhase.LEDGER_BEHIND) else None
    lost = record.frozen_reason == "LedgerLost"
    message = (("the ledger holds nothing of this task" if lost else "the ledger holds an older version of this task")
               + f", though its status showed version {shown.ledger_version}"
               + (f" ({was})" if was else "")
               + ": it was restored from a backup or lost commits. Nothing runs until a human recovers it: "
               "`kubectl retex recover TASK --from-status` (steps shown done stay done) or `--afresh`")
    conditions = set_condition(shown.conditions, ConditionType.LEDGER_BEHIND, "True", record.frozen_reason or LEDGER_BEHIND,
                               message, observed_generation=generation, now=now)
    return shown.model_copy(update={"phase": ShownPhase.LEDGER_BEHIND, "conditions": conditions, "lease": None,
                                    "ledger_version": record.version, "observed_generation": generation})


def recovered_conditions(status: TaskStatus | None, *, generation: int | None, now: datetime) -> TaskStatus | None:
    """The status shown before a recovery, its LedgerBehind condition set False, so the next
    status computed from it says the freeze ended (None: nothing shown)."""
    if status is None or not any(c.type == ConditionType.LEDGER_BEHIND for c in status.conditions or ()):
        return status
    conditions = set_condition(status.conditions, ConditionType.LEDGER_BEHIND, "False", "Recovered",
                               "recovered by a human", observed_generation=generation, now=now)
    return status.model_copy(update={"conditions": conditions})
