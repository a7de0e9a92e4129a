"""Attacks from a tenant namespace on the ledger: workers hold no database
credentials, and a pod's token acts for its own attempt only.

The attacker may create anything a tenant may create in namespace A (Jobs, Pods with any labels,
tokens of its ServiceAccounts) and aims at a task of namespace B. Each attack is sent to the real
ledger endpoint (served by the test, as the operator serves it) and checked on the ledger itself:
refused with a message that says why, and not one row changed.
"""

from __future__ import annotations

import json
import uuid

import pytest
import urllib3
from kubernetes import client

from e2e.attempt_identity import LocalLedgerEndpoint, pending_attempt_pod, pod_token
from e2e.system import discard_namespace, prepare_namespace
from retex.api.models import TaskSpec
from retex.kube.objects import WorkerDefaults, build_job
from retex.ledger import TaskAdmission

ATTACKER, VICTIM = "tenancy-attacker", "tenancy-victim"
SPEC = {"steps": [{"name": "charge", "exec": {"command": ["true"]}}]}


@pytest.fixture(scope="module")
def api(rig):
    for namespace in (ATTACKER, VICTIM):
        prepare_namespace(rig.kubectl, namespace)
    with rig.api_client() as api_client:
        yield api_client
    for namespace in (ATTACKER, VICTIM):
        discard_namespace(rig.kubectl, namespace)


@pytest.fixture
def endpoint(ledger, api):
    served = LocalLedgerEndpoint(ledger, api)
    yield served
    served.close()


def admit(ledger, namespace: str) -> tuple[str, str]:
    uid = str(uuid.uuid4())
    name = f"order-{uid[:8]}"
    ledger.admit(TaskAdmission(uid=uid, namespace=namespace, name=name, spec=SPEC, step_names=["charge"]))
    return uid, name


def job(namespace: str, task_name: str, task_uid: str, epoch: int = 1) -> dict:
    body = build_job(task_name=task_name, task_uid=task_uid, namespace=namespace, epoch=epoch,
                     spec=TaskSpec.model_validate(SPEC),
                     defaults=WorkerDefaults(image="retex-worker:local", service_account="retex-worker",
                                             ledger_url="http://unused"))
    body["metadata"].pop("ownerReferences")  # no Task object: the ledger row is the task here
    return body


def call(endpoint: LocalLedgerEndpoint, token: str | None, operation: str, **body) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    http = urllib3.PoolManager(ca_cert_data=endpoint.ca_pem, cert_reqs="CERT_REQUIRED")
    reply = http.request("POST", f"{endpoint.url}/v1/attempt/{operation}", body=json.dumps(body).encode(),
                         headers=headers, retries=False, timeout=30)
    return reply.status, json.loads(reply.data or b"{}")


def unchanged(ledger, uid: str, before) -> None:
    after = ledger.get(uid)
    assert (after.version, after.epoch, [s.state for s in after.steps]) == \
        (before.version, before.epoch, [s.state for s in before.steps])
    assert ledger.attempts(uid)[0].pod is None, "nobody claimed the victim's attempt"


def test_a_pod_of_one_attempt_cannot_act_for_another_namespaces_task(ledger, api, endpoint, tmp_path):
    mine, mine_name = admit(ledger, ATTACKER)
    victim, _ = admit(ledger, VICTIM)
    before = ledger.get(victim)
    token = pod_token(api, pending_attempt_pod(api, job(ATTACKER, mine_name, mine)), tmp_path / "t").read_text()

    assert call(endpoint, token, "get", uid=mine)[0] == 200  # the token works for its own attempt
    status, reply = call(endpoint, token, "claim_attempt", uid=victim, epoch=1, node="evil")
    assert status == 403 and f"runs attempt 1 of task {mine}" in reply["message"], reply
    status, reply = call(endpoint, token, "get", uid=victim)
    assert status == 403, reply  # not even a read: another task's spec and results stay private
    unchanged(ledger, victim, before)


def test_a_pod_cannot_act_for_another_epoch_of_its_own_task(ledger, api, endpoint, tmp_path):
    uid, name = admit(ledger, ATTACKER)
    before = ledger.get(uid)
    token = pod_token(api, pending_attempt_pod(api, job(ATTACKER, name, uid)), tmp_path / "t").read_text()
    status, reply = call(endpoint, token, "begin_step", uid=uid, epoch=2, idx=0)
    assert status == 403 and "may not act for task" in reply["message"], reply
    unchanged(ledger, uid, before)


def test_a_forged_worker_in_one_namespace_for_a_task_of_another_is_refused(ledger, api, endpoint, tmp_path):
    victim, victim_name = admit(ledger, VICTIM)
    before = ledger.get(victim)
    # Everything a tenant of ATTACKER controls: a Job named and labelled exactly like the victim's
    # attempt, its pod, and that pod's token for the ledger's audience.
    forged = job(VICTIM, victim_name, victim)
    forged["metadata"]["namespace"] = ATTACKER
    token = pod_token(api, pending_attempt_pod(api, forged), tmp_path / "t").read_text()
    status, reply = call(endpoint, token, "claim_attempt", uid=victim, epoch=1, node="evil")
    assert status == 403 and f"is not a worker of task {victim}" in reply["message"], reply
    assert VICTIM not in reply["message"]  # nothing told of the task but the uid the caller named
    status, reply = call(endpoint, token, "commit_step", uid=victim, epoch=1, idx=0, result={"stolen": True})
    assert status == 403, reply
    unchanged(ledger, victim, before)


def test_tokens_that_are_not_a_worker_pods_ledger_token_are_refused(ledger, api, endpoint, tmp_path):
    uid, name = admit(ledger, ATTACKER)
    before = ledger.get(uid)
    pod = pending_attempt_pod(api, job(ATTACKER, name, uid))
    # The same pod's token for the API server's audience (what every pod has mounted).
    api_token = client.CoreV1Api(api).create_namespaced_service_account_token(
        "retex-worker", ATTACKER, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid)))).status.token
    # A ServiceAccount token for the right audience, but bound to no pod.
    unbound = client.CoreV1Api(api).create_namespaced_service_account_token(
        "retex-worker", ATTACKER, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=["retex-ledger"]))).status.token
    for token, why in [(None, "no bearer token"), ("not-a-token", "token not accepted"),
                       (api_token, "token not accepted for audience retex-ledger"),
                       (unbound, "is not a pod-bound ServiceAccount token")]:
        status, reply = call(endpoint, token, "claim_attempt", uid=uid, epoch=1, node="evil")
        assert status == 401 and why in reply["message"], (why, reply)
    unchanged(ledger, uid, before)


def test_a_pod_with_the_labels_but_no_job_is_refused(ledger, api, endpoint, tmp_path):
    uid, name = admit(ledger, ATTACKER)
    before = ledger.get(uid)
    template = job(ATTACKER, name, uid)["spec"]["template"]
    pod = client.CoreV1Api(api).create_namespaced_pod(ATTACKER, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "bare-", **template["metadata"]},
        "spec": {**template["spec"], "nodeSelector": {"retex.dev/test-node": "nowhere"}}})
    token = pod_token(api, pod, tmp_path / "t").read_text()
    status, reply = call(endpoint, token, "claim_attempt", uid=uid, epoch=1, node="evil")
    assert status == 401 and "is not controlled by a Job" in reply["message"], reply
    unchanged(ledger, uid, before)


def test_a_worker_pod_run_by_the_operator_holds_no_database_credentials(retex):
    """The Job the operator builds: no Secret in its env, no DSN anywhere in the pod, none in the namespace."""
    retex.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "retex.dev/v1alpha1", "kind": "Task", "metadata": {"name": "plain"},
        "spec": {"steps": [{"name": "env", "exec": {"command": ["sh", "-c", "env"]}}]}}))
    retex.kubectl("wait", "--for=condition=Succeeded", "--timeout=90s", "task/plain")
    jobs = json.loads(retex.kubectl("get", "jobs", "-o", "json").stdout)["items"]
    assert jobs
    for body in jobs:
        pod = body["spec"]["template"]["spec"]
        text = json.dumps(pod)
        assert "secretKeyRef" not in text and "DATABASE" not in text and retex.dsn not in text
    assert not json.loads(retex.kubectl("get", "secrets", "-o", "json").stdout)["items"]
    # What the step itself saw: no DSN in its environment.
    record = retex.ledger.find(retex.namespace, "plain")
    assert retex.dsn not in record.steps[0].result["stdout"] and "DATABASE_URL" not in record.steps[0].result["stdout"]
