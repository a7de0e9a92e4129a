"""kopf handlers carrying each namespace's own run limit (its TaskPolicy's maxRunning) into the
ledger, which knows no TaskPolicy; every placement applies it with the global limits.

Each leadership starts from a whole list (`replace_run_limits`, before kopf watches anything), so
a TaskPolicy deleted while no leader watched leaves no limit behind; then each change of a
TaskPolicy named `default` is written as it is seen (`taskpolicy_changed`). Both are the
leader's writes, fenced by its term. Event handlers only: kopf then writes nothing onto a
TaskPolicy (no finalizer, no annotations), so the operator needs only to read them.
"""

from __future__ import annotations

from typing import Any

import kopf

from retex.api import GROUP, VERSION
from retex.kube.operator_calls import TASK_POLICIES, TASK_POLICY_NAME, run_limit_of
from retex.operator.handlers import Runtime, leader_only


@kopf.on.startup()
@leader_only
def replace_run_limits(memo: kopf.Memo, **_: Any) -> None:
    """Every namespace's run limit from one list of the TaskPolicies, at each start of kopf (each
    leadership); kopf retries it until it passes, before it watches anything."""
    runtime: Runtime = memo.runtime
    runtime.ledger.replace_namespace_run_limits(runtime.kube.namespace_run_limits())


@kopf.on.event(GROUP, VERSION, TASK_POLICIES, when=lambda name, **_: name == TASK_POLICY_NAME)
@leader_only
def taskpolicy_changed(event: kopf.RawEvent, namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A TaskPolicy `default` listed, added, changed or deleted: its namespace's run limit is its
    maxRunning (none once it is unset or the TaskPolicy is deleted); a raised or lifted limit
    fills the slots it opened."""
    runtime: Runtime = memo.runtime
    limit = None if event["type"] == "DELETED" else run_limit_of(dict(body))
    runtime.ledger.set_namespace_run_limit(namespace, limit)
