"""The operator's status and Event calls answer in retex's terms: a status patch the API server
answers 404 (the Task is gone), 409 (another Task has its name: the uid precondition) or 422 of the
CRD's ledgerVersion rule alone (a newer status is shown) is `StatusNotWritten`; an Event it refuses
is `EventNotPosted`; callers never branch on HTTP numbers. Other failures, a 422 of the schema or of
another rule among them, stay what they are. The 422 bodies are the rig's kube-apiserver's own."""

import json
from types import SimpleNamespace

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from retex.kube.operator_calls import EventNotPosted, KubeCalls, StatusNotWritten

TASK = {"apiVersion": "retex.dev/v1alpha1", "kind": "Task",
        "metadata": {"name": "order-1", "namespace": "shop", "uid": "u-1"}}


def calls_answering(exc: Exception) -> KubeCalls:
    def fail(*args, **kwargs):
        raise exc

    calls = KubeCalls(client.ApiClient(), instance="retex-operator-0", request_timeout=5.0)
    calls._custom = SimpleNamespace(patch_namespaced_custom_object_status=fail)
    calls._core = SimpleNamespace(create_namespaced_event=fail)
    return calls



def invalid(*causes: tuple[str, str, str]) -> ApiException:
    """A 422 as kube-apiserver answers a status the CRD refuses: (reason, message, field) per cause."""
    exc = ApiException(status=422, reason="Unprocessable Entity")
    messages = [f"{field}: {message}" for _, message, field in causes]
    listed = messages[0] if len(messages) == 1 else f"[{', '.join(messages)}]"
    exc.body = json.dumps({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Invalid", "code": 422,
        "message": f'Task.retex.dev "order-1" is invalid: {listed}',
        "details": {"name": "order-1", "group": "retex.dev", "kind": "Task",
                    "causes": [{"reason": r, "message": m, "field": f} for r, m, f in causes]}})
    return exc


OLDER_THAN_SHOWN = ("FieldValueInvalid", "Invalid value: status.ledgerVersion never goes backwards", "status")
NOT_CHECKED = ("FieldValueInvalid", "Invalid value: null: some validation rules were not checked because the object "
               "was invalid; correct the existing errors to complete validation", "<nil>")


@pytest.mark.parametrize("exc", [ApiException(status=404), ApiException(status=409), invalid(OLDER_THAN_SHOWN)],
                         ids=["gone", "replaced", "older-than-shown"])
def test_a_status_patch_answered_gone_replaced_or_older_is_status_not_written(exc):
    with pytest.raises(StatusNotWritten) as refused:
        calls_answering(exc).patch_task_status("shop", "order-1", "u-1", {"ledgerVersion": 3})
    assert refused.value.http_status == exc.status


@pytest.mark.parametrize("exc", [
    ApiException(status=500),
    ApiException(status=403, reason="Forbidden"),
    invalid(("FieldValueTooLong", "Too long: may not be more than 4096 bytes", "status.lastError"), NOT_CHECKED),
    invalid(("FieldValueNotSupported", 'Unsupported value: "Nope": supported values: "Pending"', "status.phase"),
            NOT_CHECKED),
    invalid(("FieldValueInvalid", "Invalid value: another rule of the status", "status"), OLDER_THAN_SHOWN),
    ApiException(status=422, reason="Unprocessable Entity"),
], ids=["500", "403", "schema-too-long", "schema-enum", "another-rule-too", "422-without-body"])
def test_a_status_patch_failing_otherwise_raises_as_it_was(exc):
    """A 422 of the schema or of another rule says the status the operator computed is wrong: never
    let go of as stale (the mirror retries, counts and logs it)."""
    with pytest.raises(ApiException) as raised:
        calls_answering(exc).patch_task_status("shop", "order-1", "u-1", {})
    assert raised.value is exc


def test_an_event_the_api_server_refuses_is_event_not_posted():
    with pytest.raises(EventNotPosted) as refused:
        calls_answering(ApiException(status=403, reason="Forbidden")).post_event(TASK, reason="Failed", message="x")
    assert refused.value.http_status == 403
