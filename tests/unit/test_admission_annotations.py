"""The annotation room a Task must leave for the operator (pure): kubectl apply's copy of a full
non-ASCII payload fits; a Task already near the API server's 256 KiB limit is refused."""

import json

from retex.api.models import ANNOTATIONS_MAX_BYTES, OPERATOR_ANNOTATIONS_RESERVE_BYTES
from retex.operator.admission import annotations_refusal

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def test_kubectl_applys_copy_of_a_payload_at_the_limit_leaves_room_for_the_operator():
    spec = {"steps": [{"name": "s", "exec": {"command": ["true"]}}], "payload": {"note": "é" * 32700}}
    applied = {LAST_APPLIED: json.dumps({"kind": "Task", "spec": spec}, ensure_ascii=False)}
    assert annotations_refusal(applied, own_prefix="kopf.retex.dev") is None


def test_annotations_leaving_less_than_the_operators_reserve_are_refused_with_the_sizes():
    room = ANNOTATIONS_MAX_BYTES - OPERATOR_ANNOTATIONS_RESERVE_BYTES
    key = "example.com/blob"
    fits = {key: "a" * (room - len(key))}
    assert annotations_refusal(fits, own_prefix="kopf.retex.dev") is None
    why = annotations_refusal({key: "a" * (room - len(key) + 1)}, own_prefix="kopf.retex.dev")
    assert why is not None and f"take {room + 1} bytes" in why and f"at most {room}" in why
    # the operator's own annotations are replaced by its next patch, not added: not counted
    assert annotations_refusal({**fits, "kopf.retex.dev/last-handled-configuration": "x" * 4096},
                               own_prefix="kopf.retex.dev") is None
