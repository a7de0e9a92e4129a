"""set_condition: one condition per type, lastTransitionTime moves only when the status does."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from retex.api import Condition, ConditionType, find_condition, set_condition

T0 = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def test_a_new_condition_is_appended_with_now_as_transition_time():
    conditions = set_condition([], ConditionType.ACCEPTED, "True", "Valid", "spec accepted", observed_generation=1, now=T0)
    assert conditions == [
        Condition(
            type="Accepted", status="True", reason="Valid", message="spec accepted", observed_generation=1, last_transition_time=T0
        )
    ]


def test_same_status_keeps_transition_time_but_takes_the_new_reason_message_and_generation():
    before = set_condition([], ConditionType.RUNNING, "True", "AttemptStarted", "attempt 1", observed_generation=1, now=T0)
    after = set_condition(before, ConditionType.RUNNING, "True", "AttemptReplaced", "attempt 2", observed_generation=2, now=T1)
    (running,) = after
    assert running.last_transition_time == T0
    assert (running.reason, running.message, running.observed_generation) == ("AttemptReplaced", "attempt 2", 2)


def test_changed_status_moves_transition_time():
    before = set_condition([], ConditionType.RUNNING, "True", "AttemptStarted", "", observed_generation=1, now=T0)
    (running,) = set_condition(before, ConditionType.RUNNING, "False", "Succeeded", "", observed_generation=1, now=T1)
    assert running.status == "False" and running.last_transition_time == T1


def test_other_conditions_and_their_order_are_kept():
    conditions = set_condition([], ConditionType.ACCEPTED, "True", "Valid", "", observed_generation=1, now=T0)
    conditions = set_condition(conditions, ConditionType.RUNNING, "True", "AttemptStarted", "", observed_generation=1, now=T0)
    conditions = set_condition(conditions, ConditionType.ACCEPTED, "True", "Valid", "again", observed_generation=1, now=T1)
    assert [c.type for c in conditions] == ["Accepted", "Running"]
    assert find_condition(conditions, "Accepted").message == "again"
    assert find_condition(conditions, ConditionType.FAILED) is None


def test_input_list_is_not_modified():
    before = set_condition([], ConditionType.RUNNING, "True", "AttemptStarted", "", observed_generation=1, now=T0)
    snapshot = [c.model_copy() for c in before]
    set_condition(before, ConditionType.RUNNING, "False", "Done", "", observed_generation=1, now=T1)
    assert before == snapshot


updates = st.lists(
    st.tuples(st.sampled_from(list(ConditionType)), st.sampled_from(["True", "False", "Unknown"])), max_size=30
)


@given(updates)
def test_any_update_sequence_keeps_one_condition_per_type_and_the_time_of_the_last_status_change(sequence):
    conditions: list[Condition] = []
    last_change: dict[ConditionType, tuple[str, datetime]] = {}
    for tick, (type, status) in enumerate(sequence):
        now = T0 + timedelta(seconds=tick)
        conditions = set_condition(conditions, type, status, "Reason", "", observed_generation=tick, now=now)
        if type not in last_change or last_change[type][0] != status:
            last_change[type] = (status, now)
    assert len({c.type for c in conditions}) == len(conditions)
    assert {c.type: (c.status, c.last_transition_time) for c in conditions} == last_change
