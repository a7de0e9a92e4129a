"""The Job and Lease of an attempt, built by pure functions."""

import re
import uuid

import pytest

from retex.api import TaskSpec
from retex.kube.objects import LABEL_EPOCH, LABEL_TASK_UID, WorkerDefaults, build_job, build_lease, job_name, lease_name
from retex.ledger import spec_hash

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DEFAULTS = WorkerDefaults(image="retex-worker:test", service_account="retex-worker",
                          ledger_url="http://retex-ledger.retex-system.svc:8081")
UID = "0b7c5f0e-8a1d-4e52-9d3c-1f2e3d4c5b6a"


def spec(**extra):
    return TaskSpec.model_validate({"steps": [{"name": "charge", "exec": {"command": ["true"]}}], **extra})


def job(**extra):
    return build_job(task_name="order-1", task_uid=UID, namespace="shop", epoch=3, spec=spec(**extra),
                     defaults=DEFAULTS)


def test_secret_keys_the_steps_name_reach_the_worker_as_secret_key_refs_never_as_values():
    built = build_job(task_name="order-1", task_uid=UID, namespace="shop", epoch=1, defaults=DEFAULTS,
                      spec=TaskSpec.model_validate({"steps": [
                          {"name": "a", "exec": {"command": ["x"], "env": [
                              {"name": "API_TOKEN", "valueFrom": {"secretKeyRef": {"name": "shop-api", "key": "token"}}},
                              {"name": "MODE", "value": "fast"}]}},
                          {"name": "b", "http": {"method": "GET", "url": "https://x.example/", "headersFrom": [
                              {"name": "Authorization",
                               "valueFrom": {"secretKeyRef": {"name": "shop-api", "key": "token"}}}]}}]}))
    env = built["spec"]["template"]["spec"]["containers"][0]["env"]
    secrets = [e for e in env if e["name"].startswith("RETEX_SECRET_")]
    assert secrets == [{"name": secrets[0]["name"], "valueFrom": {"secretKeyRef": {"name": "shop-api", "key": "token"}}}]
    assert all("value" not in e for e in secrets)


@pytest.mark.parametrize("name", ["a", "order-1", "x" * 253, "a.b.c." * 42 + "z", "-weird-"])
def test_names_fit_a_dns_label_for_any_task_name(name):
    for built in (job_name(name, UID, 12345), lease_name(name, UID)):
        assert len(built) <= 63 and DNS_LABEL.match(built), built


def test_names_are_deterministic_per_task_and_attempt():
    assert job_name("order-1", UID, 1) == job_name("order-1", UID, 1)
    assert job_name("order-1", UID, 1) != job_name("order-1", UID, 2)
    assert job_name("order-1", UID, 1) != job_name("order-1", str(uuid.uuid4()), 1)  # a recreated Task
    long = "x" * 253
    assert job_name(long, UID, 1) != job_name(long, UID, 2)


def test_the_job_never_retries_by_itself_and_belongs_to_the_task():
    body = job()
    assert body["spec"]["backoffLimit"] == 0
    assert body["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert body["spec"]["ttlSecondsAfterFinished"] == 600
    owner = body["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("Task", UID, True)
    labels = body["spec"]["template"]["metadata"]["labels"]
    assert (labels[LABEL_TASK_UID], labels[LABEL_EPOCH]) == (UID, "3")


def test_the_worker_gets_its_epoch_and_lease_and_no_database_credentials():
    pod = job()["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["RETEX_EPOCH"]["value"] == "3"
    assert env["RETEX_LEASE_NAME"]["value"] == lease_name("order-1", UID)
    assert env["RETEX_LEASE_DURATION_SECONDS"]["value"] == "15"
    # The worker runs only the spec the Job was built from (the live Task's), by this hash.
    assert env["RETEX_SPEC_HASH"]["value"] == spec_hash(spec().as_admitted())
    assert not [e for e in container["env"] if "secretKeyRef" in (e.get("valueFrom") or {})]
    assert "RETEX_DATABASE_URL" not in env
    assert env["RETEX_LEDGER_URL"]["value"] == "http://retex-ledger.retex-system.svc:8081"
    # The ledger endpoint's credential: a projected token bound to the pod, for its audience only.
    token_file = env["RETEX_LEDGER_TOKEN_FILE"]["value"]
    [mount] = [m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    [source] = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == "retex-ledger"
    assert token_file == f"{mount['mountPath']}/{source['serviceAccountToken']['path']}" and mount["readOnly"]
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["RETEX_DRAIN_SECONDS"]["value"] == "25"  # 30 s grace, 5 s to commit and release


def test_no_services_of_the_tenant_namespace_reach_the_workers_environment():
    # A Service named retex-<x> would set RETEX_<X>_PORT and the like, the worker's own prefix.
    assert job()["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_the_worker_pod_is_non_root_without_capabilities():
    pod = job()["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                            "readOnlyRootFilesystem": True, "runAsNonRoot": True}


def test_pods_on_a_lost_node_are_evicted_quickly_and_user_tolerations_are_kept():
    tolerations = job(worker={"tolerations": [{"key": "gpu", "operator": "Exists"}]})["spec"]["template"]["spec"]["tolerations"]
    lost = {t["key"]: t["tolerationSeconds"] for t in tolerations if t.get("effect") == "NoExecute"}
    assert lost == {"node.kubernetes.io/not-ready": 10, "node.kubernetes.io/unreachable": 10}
    assert {"key": "gpu", "operator": "Exists"} in tolerations


def test_the_time_left_of_the_task_becomes_the_jobs_active_deadline():
    assert "activeDeadlineSeconds" not in job()["spec"]
    limited = build_job(task_name="t", task_uid=UID, namespace="ns", epoch=2, spec=spec(timeoutSeconds=600),
                        defaults=DEFAULTS, active_deadline_seconds=310)
    assert limited["spec"]["activeDeadlineSeconds"] == 310


def test_spec_worker_overrides_image_account_resources_and_placement():
    pod = job(worker={"image": "acme/steps:1", "serviceAccountName": "payments", "nodeSelector": {"pool": "a"},
                      "resources": {"limits": {"memory": "256Mi"}}})["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "acme/steps:1"
    assert pod["serviceAccountName"] == "payments"
    assert pod["nodeSelector"] == {"pool": "a"}
    assert pod["containers"][0]["resources"] == {"limits": {"memory": "256Mi", "ephemeral-storage": "2Gi"}}


def test_a_worker_cannot_fill_its_node_disk_unless_the_task_asks_for_more():
    pod = job()["spec"]["template"]["spec"]
    [scratch] = [v for v in pod["volumes"] if v["name"] == "scratch"]
    assert scratch["emptyDir"] == {"sizeLimit": "1Gi"}
    assert pod["containers"][0]["resources"] == {"limits": {"ephemeral-storage": "2Gi"}}
    asked = job(worker={"resources": {"requests": {"ephemeral-storage": "5Gi"}, "limits": {"ephemeral-storage": "8Gi"}}})
    assert asked["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"ephemeral-storage": "5Gi"}, "limits": {"ephemeral-storage": "8Gi"}}


def test_the_lease_is_created_free_with_the_spec_duration():
    lease = build_lease(task_name="order-1", task_uid=UID, namespace="shop", duration_seconds=20)
    assert lease["spec"] == {"leaseDurationSeconds": 20}
    assert lease["metadata"]["labels"][LABEL_TASK_UID] == UID
    assert lease["metadata"]["ownerReferences"][0]["uid"] == UID


def test_a_failpoint_reaches_the_worker_only_when_asked():
    def env_of(body):
        return {e["name"]: e.get("value") for e in body["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert "RETEX_FAILPOINT" not in env_of(job())
    armed = build_job(task_name="t", task_uid=UID, namespace="ns", epoch=1, spec=spec(), defaults=DEFAULTS,
                      failpoint="after-effect:charge")
    assert env_of(armed)["RETEX_FAILPOINT"] == "after-effect:charge"


def test_a_replacement_attempt_prefers_a_node_other_than_the_lost_one():
    assert "affinity" not in job()["spec"]["template"]["spec"]
    body = build_job(task_name="t", task_uid=UID, namespace="ns", epoch=2, spec=spec(), defaults=DEFAULTS,
                     avoid_node="node-a")
    preferred = body["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["preference"]["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": ["node-a"]}]


@pytest.mark.parametrize("name", ["a", "order-1", "x" * 253, "a.b.c." * 42 + "z"])
def test_a_job_name_survives_whole_in_its_pods_names_so_they_name_the_tasks_lease_and_epoch(name):
    """The Job controller names pods `<job>-<5 chars>` and cuts the base at 58 characters: the
    lease policy (manifests/base/lease-policy.yaml) knows a worker pod's task and epoch only from
    a pod name ending in `-<the Lease name's hash>-<epoch>-<5 chars>`."""
    built = job_name(name, UID, 12345)
    assert len(built + "-") <= 58, built
    assert built.endswith(f"-{lease_name(name, UID)[-8:]}-12345")
