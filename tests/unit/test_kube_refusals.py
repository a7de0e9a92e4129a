"""Which refusals of a create are for good, which mean the namespace is going, which pass; which
errors of any call may clear by itself (retex.kube.errors)."""

import json

import urllib3
from kubernetes.client.exceptions import ApiException

from retex.kube.errors import NamespaceTerminating, Refused, refusal, transient


def answer(status: int, message: str, causes: list[dict] | None = None) -> ApiException:
    exc = ApiException(status=status, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "code": status, "message": message,
                           "details": {"causes": causes or []}})
    return exc


def test_a_create_in_a_terminating_namespace_says_the_namespace_is_going():
    # As NamespaceLifecycle answers (k8s.io/apiserver, admission/plugin/namespace/lifecycle).
    exc = answer(403, 'leases.coordination.k8s.io "t-1" is forbidden: unable to create new content in '
                      "namespace tenant because it is being terminated",
                 [{"reason": "NamespaceTerminating", "message": "namespace tenant is being terminated",
                   "field": "metadata.namespace"}])
    assert isinstance(refusal(exc), NamespaceTerminating)


def test_a_full_quota_is_transient_not_a_refusal():
    exc = answer(403, 'jobs.batch "t-1" is forbidden: exceeded quota: jobs, requested: count/jobs.batch=1, '
                      "used: count/jobs.batch=2, limited: count/jobs.batch=2")
    assert refusal(exc) is None
    assert refusal(answer(403, 'jobs.batch "t-1" is forbidden: status unknown for quota: jobs')) is None


def test_an_admission_policy_403_and_an_invalid_object_are_refusals_with_the_servers_message():
    for status, message in [(403, 'jobs.batch "t-1" is forbidden: violates PodSecurity "restricted"'),
                            (422, 'Job.batch "t-1" is invalid: spec.template.spec.containers[0].resources')]:
        refused = refusal(answer(status, message))
        assert type(refused) is Refused and refused.message == message and refused.status == status


def test_server_errors_and_throttling_are_transient():
    assert refusal(answer(500, "etcdserver: request timed out")) is None
    assert refusal(answer(429, "too many requests")) is None


def test_connection_level_failures_server_errors_and_a_full_quota_are_transient_but_refusals_for_good_are_not():
    assert transient(ApiException(status=0, reason="SSLError"))  # the client's wrapper for no response
    assert transient(answer(503, "unavailable")) and transient(answer(429, "too many requests"))
    assert transient(answer(403, 'jobs.batch "t-1" is forbidden: exceeded quota: jobs'))
    assert transient(urllib3.exceptions.ProtocolError("reset")) and transient(ConnectionRefusedError())
    for status, message in [(400, "bad request"), (403, 'jobs.batch "t-1" is forbidden: violates PodSecurity'),
                            (404, 'namespaces "gone" not found'), (422, 'Job.batch "t-1" is invalid')]:
        assert not transient(answer(status, message)), status
    assert not transient(ValueError("a bug"))
