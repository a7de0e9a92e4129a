"""The operator's status and Event calls answer in retex's terms: a status patch the API server
answers 404 (the Task is gone), 409 (another Task has its name: the uid precondition) or 422 (a
newer status is shown: the CRD's ledgerVersion rule) is `StatusNotWritten`; an Event it refuses is
`EventNotPosted`; callers never branch on HTTP numbers. Other failures stay what they are."""

from types import SimpleNamespace

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from retex.kube.calls import EventNotPosted, KubeCalls, StatusNotWritten

TASK = {"apiVersion": "retex.dev/v1alpha1", "kind": "Task",
        "metadata": {"name": "order-1", "namespace": "shop", "uid": "u-1"}}


def calls_answering(exc: Exception) -> KubeCalls:
    def fail(*args, **kwargs):
        raise exc

    calls = KubeCalls(client.ApiClient(), instance="retex-operator-0", request_timeout=5.0)
    calls._custom = SimpleNamespace(patch_namespaced_custom_object_status=fail)
    calls._core = SimpleNamespace(create_namespaced_event=fail)
    return calls


@pytest.mark.parametrize("code", [404, 409, 422])
def test_a_status_patch_answered_gone_replaced_or_older_is_status_not_written(code):
    with pytest.raises(StatusNotWritten) as refused:
        calls_answering(ApiException(status=code)).patch_task_status("shop", "order-1", "u-1", {"ledgerVersion": 3})
    assert refused.value.http_status == code


def test_a_status_patch_failing_otherwise_raises_as_it_was():
    with pytest.raises(ApiException):
        calls_answering(ApiException(status=500)).patch_task_status("shop", "order-1", "u-1", {})


def test_an_event_the_api_server_refuses_is_event_not_posted():
    with pytest.raises(EventNotPosted) as refused:
        calls_answering(ApiException(status=403, reason="Forbidden")).post_event(TASK, reason="Failed", message="x")
    assert refused.value.http_status == 403
