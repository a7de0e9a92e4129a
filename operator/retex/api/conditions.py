"""Setting a condition the way apimachinery's meta.SetStatusCondition does. Pure: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

from retex.api.models import Condition, ConditionType


def find_condition(conditions: Sequence[Condition] | None, type: ConditionType | str) -> Condition | None:
    for condition in conditions or ():
        if condition.type == type:
            return condition
    return None


def set_condition(
    conditions: Sequence[Condition] | None,
    type: ConditionType | str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
    *,
    observed_generation: int | None,
    now: datetime,
) -> list[Condition]:
    """A new condition list with `type` set. lastTransitionTime moves to `now` only when the status
    changes (or the condition is new), so it tells when the status flipped, not when it was last
    written. Other conditions and their order are kept; a new type is appended."""
    existing = find_condition(conditions, type)
    updated = Condition(
        type=type,
        status=status,
        reason=reason,
        message=message,
        observed_generation=observed_generation,
        last_transition_time=now if existing is None or existing.status != status else existing.last_transition_time,
    )
    if existing is None:
        return [*(conditions or ()), updated]
    return [updated if condition.type == type else condition for condition in conditions or ()]
