"""manifests/ and examples/ build with kustomize and are accepted by a real API server.

`kubectl apply --server-side --dry-run=server` runs everything but the write: schema and CEL validation, defaulting,
admission (Pod Security included). The namespaces are created for real first (a dry-run namespace
does not exist for the objects in it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e.system import apply_task_policy, default_task_policy, discard_namespace, install_crd
from retex.api import TaskSpec
from retex.kube.objects import WorkerDefaults, build_job

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
EXAMPLES = ROOT / "examples"
OVERLAYS = {"base": MANIFESTS / "base", "dev": MANIFESTS / "overlays" / "dev",
            "local": MANIFESTS / "overlays" / "local", "finalizer-at-create": MANIFESTS / "finalizer-at-create"}
TASK_EXAMPLES = sorted(EXAMPLES.glob("*.yaml")) + [EXAMPLES / "custom-worker" / "task.yaml"]


def kustomize(rig, name: str) -> list[dict]:
    built = rig.kubectl("kustomize", str(OVERLAYS[name])).stdout
    return [doc for doc in yaml.safe_load_all(built) if doc]


def kinds(objects: list[dict]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def dry_run(rig, objects: list[dict], *args: str):
    """Server-side apply (as docs/install.md says to apply), dry-run; returns kubectl's stderr."""
    result = rig.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server", *args, "-f", "-",
                         check=False, input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def namespaces(rig):
    """For real: the local overlay (namespace, CRD, operator RBAC, as `make dev` applies it) and the
    dev overlay's tenant namespace; everything else is a dry-run."""
    install_crd(rig.kubectl)
    rig.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(OVERLAYS["local"]))
    for namespace in (o for o in kustomize(rig, "dev") if o["kind"] == "Namespace"):
        rig.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(namespace))
    rig.kubectl("create", "namespace", "examples-check", check=False)
    # The shipped default TaskPolicy, plus the custom worker example's image: the examples ask for
    # nothing else.
    apply_task_policy(rig.kubectl, "examples-check", default_task_policy(images=["shop-worker:"]))
    yield
    discard_namespace(rig.kubectl, "examples-check")


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_every_kustomization_is_accepted_by_the_api_server(rig, namespaces, name):
    warnings = dry_run(rig, kustomize(rig, name))
    assert "Warning" not in warnings, warnings


def test_local_overlay_is_the_base_without_the_operator_deployment(rig):
    base, local = kinds(kustomize(rig, "base")), kinds(kustomize(rig, "local"))
    assert base - local == {("Deployment", "retex-operator"), ("Service", "retex-operator-metrics")}
    assert local <= base
    rules = {name: next(o for o in kustomize(rig, name) if o["kind"] == "ClusterRole")["rules"]
             for name in ("base", "local", "dev")}
    assert rules["base"] == rules["local"] == rules["dev"]


def test_operator_pod_meets_the_restricted_pod_security_standard(rig, namespaces):
    """Pod Security admission enforces on Pods, not on Deployments: dry-run the template as a Pod in
    retex-system, whose namespace enforces `restricted` (a pod without the hardening is refused)."""
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "psa-check-bare", "namespace": "retex-system"},
            "spec": {"containers": [{"name": "c", "image": "busybox:1.36", "command": ["true"]}]}}
    refused = rig.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(bare), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr, refused.stderr
    for name, kind in (("base", "Deployment"), ("dev", "StatefulSet")):
        workload = next(o for o in kustomize(rig, name) if o["kind"] == kind)
        spec = workload["spec"]["template"]["spec"]
        if kind == "StatefulSet":  # its data volume comes from volumeClaimTemplates: an emptyDir stands in
            spec["volumes"] = spec.get("volumes", []) + [{"name": "data", "emptyDir": {}}]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"psa-check-{kind.lower()}", "namespace": "retex-system"}, "spec": spec}
        assert "Warning" not in dry_run(rig, [pod])


def test_operator_deployment_is_hardened_and_probed_for_liveness_and_readiness_apart(rig):
    deployment = next(o for o in kustomize(rig, "base") if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert pod["serviceAccountName"] == "retex-operator"
    # Service links off: the Service retex-ledger would otherwise set RETEX_LEDGER_PORT to
    # "tcp://<ip>:8081" in the operator's environment, and the operator refuses to start (seen on kind).
    assert pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                             "capabilities": {"drop": ["ALL"]}}
    assert env["RETEX_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["key"] == "dsn"
    assert env["RETEX_HEALTH"]["value"] == "http://0.0.0.0:8080"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["ledger"] == 8081 and env["RETEX_LEDGER_URL"]["value"] == "https://retex-ledger.retex-system.svc:8081"
    # The endpoint's certificate: the Secret retex-ledger-tls, readable by the operator's group only.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    [secret] = [v["secret"] for v in pod["volumes"] if v["name"] == "ledger-tls"]
    assert secret == {"secretName": "retex-ledger-tls", "defaultMode": 0o440} and pod["securityContext"]["fsGroup"] == 65532
    assert {env[name]["value"].rpartition("/")[0] for name in
            ("RETEX_LEDGER_TLS_CERT_FILE", "RETEX_LEDGER_TLS_KEY_FILE", "RETEX_LEDGER_CA_FILE")} == {mounts["ledger-tls"]}
    # Readiness alone asks Postgres: an outage takes a replica out of the Service, never restarts it.
    paths = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
    for probe, path in paths.items():
        assert container[probe]["httpGet"]["path"] == path
        assert ports[container[probe]["httpGet"]["port"]] == 8080
    assert container["resources"]["requests"] and container["resources"]["limits"]


def test_operator_runs_two_replicas_on_two_nodes_never_both_down_and_elects_with_a_namespaced_role(rig):
    objects = kustomize(rig, "base")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] == 2
    # No surge: with the required anti-affinity and two nodes, a third pod could never be scheduled
    # and a rollout would never end; the PDB still keeps one replica up.
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    spread = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    [term] = spread["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == pod_labels
    [budget] = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert budget["spec"] == {"minAvailable": 1, "selector": {"matchLabels": pod_labels}}
    assert budget["metadata"]["namespace"] == deployment["metadata"]["namespace"] == "retex-system"
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RETEX_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # The election Lease: get/update by name, in retex-system only; cluster-wide never get/update.
    [role] = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "retex-operator-leader-election"]
    assert role["metadata"]["namespace"] == "retex-system"
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "resourceNames": ["retex-operator-leader"], "verbs": ["get", "update"]},
                     {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "resourceNames": ["retex-install"], "verbs": ["get"]}]
    [binding] = [o for o in objects if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "retex-operator", "namespace": "retex-system"}]
    cluster_role = next(o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "retex-operator")
    lease_verbs = {v for r in cluster_role["rules"] if "leases" in r["resources"] for v in r["verbs"]}
    assert not lease_verbs & {"get", "update", "patch"}


def test_the_shipped_role_lets_the_operator_hold_the_election_lease_in_its_namespace_only(rig, namespaces):
    user = "system:serviceaccount:retex-system:retex-operator"

    def can(verb, namespace, name=""):
        target = f"leases.coordination.k8s.io/{name}" if name else "leases.coordination.k8s.io"
        answer = rig.kubectl("auth", "can-i", verb, target, "-n", namespace, "--as", user, check=False)
        return answer.stdout.strip() == "yes"

    assert can("get", "retex-system", "retex-operator-leader") and can("update", "retex-system", "retex-operator-leader")
    assert can("create", "retex-system")
    assert not can("update", "retex-system", "some-other-lease")
    assert can("get", "retex-system", "retex-install") and not can("update", "retex-system", "retex-install")
    assert not can("get", "examples-check", "retex-operator-leader")
    assert not can("update", "examples-check", "retex-operator-leader")


def test_dev_overlay_wires_generated_secrets_and_local_images(rig):
    objects = kustomize(rig, "dev")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    secrets = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    assert env["RETEX_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] in secrets
    assert container["image"] == "retex-operator:dev" and env["RETEX_WORKER_IMAGE"]["value"] == "retex-worker:dev"
    # Tenant namespaces hold no ledger credentials: workers use the ledger endpoint.
    assert not [o for o in objects if o["kind"] == "Secret" and o["metadata"]["namespace"] == "retex-examples"]
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "retex-ledger")
    assert service["metadata"]["namespace"] == "retex-system" and service["spec"]["ports"][0]["port"] == 8081


def test_the_tenant_onboarding_applies_to_a_tenant_namespace(rig, namespaces):
    """manifests/tenant as docs/install.md applies it: worker RBAC, the operator's RoleBinding and
    the workers' NetworkPolicy, accepted by the API server as rendered."""
    built = rig.kubectl("kustomize", str(MANIFESTS / "tenant")).stdout
    objects = [doc for doc in yaml.safe_load_all(built) if doc]
    assert {("NetworkPolicy", "retex-worker-egress"), ("RoleBinding", "retex-operator"),
            ("Role", "retex-worker")} <= kinds(objects)
    assert "Warning" not in dry_run(rig, objects, "-n", "examples-check")


@pytest.mark.parametrize("example", TASK_EXAMPLES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_tasks_are_valid_against_the_crd(rig, namespaces, example):
    result = rig.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", "examples-check",
                         "-f", str(example), check=False)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr


def test_worker_jobs_meet_the_restricted_pod_security_standard_of_the_examples_namespace(rig, namespaces):
    """The dev overlay's tenant namespace enforces `restricted`: the operator's Jobs must pass it
    (Pod Security warns on a Job whose pods would be refused)."""
    namespace = next(o for o in kustomize(rig, "dev") if o["kind"] == "Namespace"
                     and o["metadata"]["name"] != "retex-system")["metadata"]["name"]
    assert "restricted" in rig.kubectl("get", "namespace", namespace, "-o", "jsonpath={.metadata.labels}").stdout
    spec = TaskSpec.model_validate(yaml.safe_load((EXAMPLES / "exec-pipeline.yaml").read_text())["spec"])
    job = build_job(task_name="psa-check", task_uid="0b7c5f0e-8a1d-4e52-9d3c-1f2e3d4c5b6a", namespace=namespace,
                    epoch=1, spec=spec, defaults=WorkerDefaults(image="retex-worker:dev", service_account="retex-worker",
                                                                ledger_url="http://retex-ledger:8081"))
    job["metadata"].pop("ownerReferences")  # no such Task exists; the pod template is what is checked
    assert "Warning" not in dry_run(rig, [job])
