"""A leadership's first resync judges the Tasks its ledger lost, and only those of the namespaces
this operator serves: a Task elsewhere belongs to another install (another ledger), whatever
version its status shows."""

from __future__ import annotations

import types
from typing import Any

from retex.operator.handlers import Runtime


def shown_admitted(namespace: str, uid: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": f"t-{uid}", "uid": uid,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"steps": [{"name": "only", "exec": {"command": ["true"]}}]},
            "status": {"phase": "Succeeded", "ledgerVersion": 7}}


def runtime(namespaces: set[str]) -> tuple[Any, list[str]]:
    judged: list[str] = []
    rt: Any = object.__new__(Runtime)
    rt._namespaces = namespaces
    rt.ledger = types.SimpleNamespace(admit_lost=lambda admission, **_: judged.append(admission.uid) or None)
    return rt, judged


def test_a_lost_task_of_a_namespace_this_operator_does_not_serve_is_not_judged():
    rt, judged = runtime({"mine"})
    rt._judge_lost(shown_admitted("theirs", "u1"))
    rt._judge_lost(shown_admitted("mine", "u2"))
    assert judged == ["u2"]


def test_an_operator_serving_every_namespace_judges_every_lost_task():
    rt, judged = runtime(set())
    rt._judge_lost(shown_admitted("anywhere", "u3"))
    assert judged == ["u3"]
