"""charts/retex renders the same objects as the kustomize manifests (no cluster: helm and kubectl's
kustomize, both local). Default values give `manifests/base` but its Namespace, object by object,
and `manifests/finalizer-at-create` besides where the API server serves MutatingAdmissionPolicy;
`tenants` gives `manifests/tenant` in each namespace; the monitoring values give
`manifests/monitoring`. A change to either side alone fails here."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.helm import CHART, SERVES_MUTATING_POLICIES, run_helm, template

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"


def kustomize(directory: Path) -> list[dict]:
    built = subprocess.run(["kubectl", "kustomize", str(directory)], text=True, capture_output=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(built) if doc]


# kustomize (5.5) does not know the admission policies are cluster-scoped and gives them the
# kustomization's namespace, which kubectl drops when it applies them.
CLUSTER_SCOPED = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                  "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"}


def without_blank_lines(value):
    """kustomize's YAML library reads a folded scalar (`>-`) with an empty line before each
    more-indented line, where the YAML spec (and PyYAML, reading the chart) has none: whitespace
    inside CEL expressions and descriptions, which is all the base has on several lines."""
    if isinstance(value, str):
        return re.sub(r"\n(?:[ \t]*\n)+", "\n", value)
    if isinstance(value, dict):
        return {k: without_blank_lines(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_blank_lines(v) for v in value]
    return value


def by_identity(objects: list[dict]) -> dict[tuple, dict]:
    objects = [without_blank_lines(o) for o in objects]
    for o in objects:
        if o["kind"] in CLUSTER_SCOPED:
            o["metadata"].pop("namespace", None)
    keyed = {(o["apiVersion"], o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
             for o in objects}
    assert len(keyed) == len(objects), "two objects with one identity"
    return keyed


def assert_same_objects(chart: list[dict], kustomized: list[dict]) -> None:
    rendered, expected = by_identity(chart), by_identity(kustomized)
    assert sorted(rendered) == sorted(expected), {"only in the chart": sorted(set(rendered) - set(expected)),
                                                  "only in kustomize": sorted(set(expected) - set(rendered))}
    differing = {key: differences(rendered[key], expected[key]) for key in expected if rendered[key] != expected[key]}
    assert not differing, "make the same change on the other side (the Task CRD's copy: make crds)\n" + "\n".join(
        f"{key}:\n" + "\n".join(f"  {line}" for line in lines) for key, lines in differing.items())


def differences(chart, kustomized, path: str = "") -> list[str]:
    """Where two parsed objects differ, as `path: chart value != kustomize value` lines."""
    if isinstance(chart, dict) and isinstance(kustomized, dict):
        return [line for key in sorted(set(chart) | set(kustomized), key=str)
                for line in differences(chart.get(key), kustomized.get(key), f"{path}.{key}")]
    if isinstance(chart, list) and isinstance(kustomized, list) and len(chart) == len(kustomized):
        return [line for i, (a, b) in enumerate(zip(chart, kustomized, strict=True))
                for line in differences(a, b, f"{path}[{i}]")]
    return [] if chart == kustomized else [f"{path}: chart {json.dumps(chart)} != kustomize {json.dumps(kustomized)}"]


def test_default_values_render_the_kustomize_base_but_its_namespace_object_by_object():
    base = kustomize(MANIFESTS / "base")
    # The Namespace is created before the release (Helm keeps its release record in it).
    assert [o["metadata"]["name"] for o in base if o["kind"] == "Namespace"] == ["retex-system"]
    assert_same_objects(template(include_crds=True), [o for o in base if o["kind"] != "Namespace"])


def test_where_the_api_server_serves_mutating_policies_the_chart_adds_manifests_finalizer_at_create():
    base = [o for o in kustomize(MANIFESTS / "base") if o["kind"] != "Namespace"]
    assert_same_objects(template(*SERVES_MUTATING_POLICIES, include_crds=True),
                        base + kustomize(MANIFESTS / "finalizer-at-create"))


def test_the_finalizer_policy_is_bound_only_to_the_watched_namespaces():
    objects = template(*SERVES_MUTATING_POLICIES, "--set", "watchNamespaces={shop,billing}")
    [binding] = [o for o in objects if o["kind"] == "MutatingAdmissionPolicyBinding"]
    assert binding["spec"]["matchResources"] == {"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["shop", "billing"]}]}}


def test_namespaces_set_through_extra_env_are_refused_for_watch_namespaces():
    result = run_helm("template", "retex", str(CHART), "--set", "extraEnv[0].name=RETEX_NAMESPACES",
                      "--set", "extraEnv[0].value=shop", check=False)
    assert result.returncode != 0 and "set the namespaces the operator serves with watchNamespaces" in result.stderr


def test_the_crds_are_in_helms_crds_directory_not_in_the_templates():
    crds = [o for o in template(include_crds=True) if o["kind"] == "CustomResourceDefinition"]
    assert sorted(o["metadata"]["name"] for o in crds) == ["taskpolicies.retex.dev", "tasks.retex.dev"]
    assert not [o for o in template() if o["kind"] == "CustomResourceDefinition"]


def test_tenants_are_onboarded_as_manifests_tenant_onboards_each_namespace():
    onboarding = kustomize(MANIFESTS / "tenant")
    expected = [{**o, "metadata": {**o["metadata"], "namespace": namespace}}
                for namespace in ("shop", "billing") for o in onboarding]
    rendered = [o for o in template("--set", "tenants={shop,billing}") if o["metadata"].get("namespace") in ("shop", "billing")]
    assert_same_objects(rendered, expected)


def test_monitoring_values_render_the_podmonitor_the_alert_rules_and_the_dashboard_as_a_configmap():
    objects = template("--set", "metrics.podMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
                       "--set", "grafanaDashboard.enabled=true")
    monitoring = [o for o in objects if o["kind"] in ("PodMonitor", "PrometheusRule")]
    assert_same_objects(monitoring, kustomize(MANIFESTS / "monitoring"))
    [dashboard] = [o for o in objects if o["kind"] == "ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {"retex.json": (MANIFESTS / "monitoring" / "grafana-dashboard.json").read_text()}, (
        "the chart's copy is stale: cp manifests/monitoring/grafana-dashboard.json charts/retex/files/")
    assert not [o for o in template() if o["kind"] in ("PodMonitor", "PrometheusRule", "ConfigMap")]


def test_values_reach_the_operator_its_rbac_and_its_secret():
    objects = template("--set", "replicas=1", "--set", "image.operator.repository=registry.example/retex-operator",
                       "--set", "image.operator.tag=0.2.0", "--set", "image.worker.repository=registry.example/retex-worker",
                       "--set", "resources.limits.memory=1Gi", "--set", "database.dsn=host=db sslmode=verify-full",
                       "--set", "watchNamespaces={shop,billing}", "--set", "extraEnv[0].name=RETEX_MAX_RUNNING",
                       "--set-string", "extraEnv[0].value=20", namespace="ops")
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert deployment["metadata"]["namespace"] == "ops" and deployment["spec"]["replicas"] == 1
    assert container["image"] == "registry.example/retex-operator:0.2.0"
    assert env["RETEX_WORKER_IMAGE"] == "registry.example/retex-worker:0.1.0"  # the chart's appVersion
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}
    assert env["RETEX_NAMESPACES"] == "shop,billing" and env["RETEX_MAX_RUNNING"] == "20"
    assert env["RETEX_LEDGER_URL"] == "https://retex-ledger.ops.svc:8081"
    [secret] = [o for o in objects if o["kind"] == "Secret"]
    assert env["RETEX_DATABASE_URL"] == {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "dsn"}}
    assert secret["stringData"] == {"dsn": "host=db sslmode=verify-full"}
    # One replica: no PodDisruptionBudget that would block every drain.
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    # Watching some namespaces, kopf lists and watches namespaces at start.
    [role] = [o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "retex-operator"]
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]} in role["rules"]
    subjects = [s for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding") for s in o["subjects"]]
    assert {s["namespace"] for s in subjects} == {"ops"}


@pytest.mark.parametrize("values", [(), ("--set", "tenants={shop}", "--set", "metrics.podMonitor.enabled=true",
                                         "--set", "grafanaDashboard.enabled=true", "--set", "replicas=1")],
                         ids=["defaults", "everything-on"])
def test_helm_lint_passes_strict(values):
    result = run_helm("lint", "--strict", str(CHART), *values, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
