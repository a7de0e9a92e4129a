"""kopf's diff base as the operator configures it: small whatever the payload, and still holding
what the field handlers react to (spec.cancel, the requeue annotation)."""

import json

import kopf
from kopf._cogs.structs.patches import Patch

from retex.kube.humans import REQUESTED_BY_ANNOTATION, RESOLVE_ANNOTATION
from retex.operator.handlers import KOPF_PREFIX, REQUEUE_ANNOTATION, ReducedDiffBaseStorage


def storage():
    return ReducedDiffBaseStorage(prefix=KOPF_PREFIX)  # what handlers.configure installs


def body(payload, *, cancel=False, annotations=None):
    spec = {"steps": [{"name": "say", "exec": {"command": ["echo", "hi"]}}], "payload": payload, "cancel": cancel}
    last_applied = json.dumps({"apiVersion": "retex.dev/v1alpha1", "kind": "Task", "spec": spec}, ensure_ascii=False)
    return kopf.Body({"apiVersion": "retex.dev/v1alpha1", "kind": "Task",
                      "metadata": {"name": "t", "namespace": "ns", "uid": "u", "annotations": {
                          "kubectl.kubernetes.io/last-applied-configuration": last_applied, **(annotations or {})}},
                      "spec": spec})


def test_the_diff_base_of_a_non_ascii_payload_under_the_limit_stays_small_next_to_kubectls_copy():
    task = body({"note": "é" * 32700})  # 64000 bytes of UTF-8: under the 64 KiB payload limit
    diffbase = storage()
    patch = Patch()
    diffbase.store(body=task, patch=patch, essence=diffbase.build(body=task))
    added = {k: v for k, v in patch["metadata"]["annotations"].items() if v is not None}
    assert size(added) < 1024, {k: len(v) for k, v in added.items()}
    assert size({**task["metadata"]["annotations"], **added}) < 256 * 1024  # the API server's limit


def size(annotations):
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


def test_the_diff_base_still_sees_cancel_and_the_requeue_annotation_change():
    diffbase = storage()
    before = diffbase.build(body=body({"a": 1}))
    after = diffbase.build(body=body({"a": 1}, cancel=True, annotations={REQUEUE_ANNOTATION: "1"}))
    assert before == {"spec": {"cancel": False}}
    assert after == {"spec": {"cancel": True}, "metadata": {"annotations": {REQUEUE_ANNOTATION: "1"}}}
    assert KOPF_PREFIX != "retex.dev"  # see handlers.configure: kopf drops its prefixes from diffs


def test_the_diff_base_sees_the_resolve_annotation_and_not_who_requested_it():
    after = storage().build(body=body({"a": 1}, annotations={RESOLVE_ANNOTATION: '{"step":"s"}',
                                                            REQUESTED_BY_ANNOTATION: "alice"}))
    assert after["metadata"] == {"annotations": {RESOLVE_ANNOTATION: '{"step":"s"}'}}
