"""The Task as the ledger's witness, the pure part: when a status is evidence that the ledger
lost something, and what a frozen task's status shows (and shows again once recovered)."""

import pytest

from retex.api import ConditionType, find_condition
from retex.machine import TaskPhase
from retex.operator.status import as_merge_patch
from retex.operator.witness import behind, frozen_status, recovered_conditions
from tests.unit.test_status import T0, record, status


@pytest.mark.parametrize("shown, ledger, is_behind", [
    (None, 3, False),  # not written yet: no evidence
    (3, 3, False), (2, 3, False),
    (4, 3, True),  # the ledger holds an older version than the one shown
    (4, None, True),  # the ledger holds nothing, though the Task showed a version
    (None, None, False),  # neither: a Task not admitted yet (or refused)
])
def test_a_status_is_evidence_of_loss_only_when_it_shows_a_version_past_the_ledgers(shown, ledger, is_behind):
    task = {"status": {} if shown is None else {"ledgerVersion": shown}}
    assert behind(task, ledger) is is_behind


def test_a_frozen_task_shows_what_its_task_showed_with_phase_and_condition_ledger_behind():
    succeeded = status(record(TaskPhase.SUCCEEDED, states=("done", "done", "done"), finished_at=T0))
    witness = as_merge_patch(succeeded)
    frozen = record(TaskPhase.PENDING, states=("pending", "pending", "pending"), version=succeeded.ledger_version + 1,
                    frozen_reason="LedgerLost", witness=witness)

    shown = frozen_status(frozen, generation=1, now=T0)

    assert shown.phase == "LedgerBehind" and shown.ledger_version == succeeded.ledger_version + 1
    assert [s.state for s in shown.steps] == ["done", "done", "done"], "the steps it showed, not the ledger's"
    assert find_condition(shown.conditions, ConditionType.SUCCEEDED).status == "True", "kubectl wait still holds"
    condition = find_condition(shown.conditions, ConditionType.LEDGER_BEHIND)
    assert (condition.status, condition.reason) == ("True", "LedgerLost")
    assert "holds nothing of this task" in condition.message and "(Succeeded)" in condition.message
    assert "kubectl retex recover" in condition.message


def test_a_recovered_task_shows_its_ledger_behind_condition_false():
    frozen = frozen_status(record(frozen_reason="LedgerBehind", witness=as_merge_patch(status(record()))),
                           generation=1, now=T0)

    after = status(record(version=20), previous=recovered_conditions(frozen, generation=1, now=T0))

    assert after.phase == "Running"
    assert find_condition(after.conditions, ConditionType.LEDGER_BEHIND).status == "False"
    assert recovered_conditions(status(record()), generation=1, now=T0).conditions == status(record()).conditions
