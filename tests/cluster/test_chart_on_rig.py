"""charts/retex on a real API server (the rig): `helm template | kubectl apply --dry-run=server`,
then `helm install`, `helm upgrade` (changed values change the objects) and `helm uninstall`
(the release's objects gone, the CRDs kept). The operator's pods never run here (the rig has no
Deployment controller and no images): what is checked is what the API server accepts and what
Helm records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.helm import CHART, SERVES_MUTATING_POLICIES, run_helm, template
from e2e.rig.controlplane import wait_for
from e2e.system import NO_TASK_POLICY, discard_namespace, dry_run_task, wait_established

ROOT = Path(__file__).resolve().parents[2]
RELEASE, NAMESPACE = "retex", "retex-system"
SHOP, BILLING, NOT_ONBOARDED = "chart-shop", "chart-billing", "chart-not-onboarded"
CRDS = ("tasks.retex.dev", "taskpolicies.retex.dev")
INSTALL_VALUES = ("--set", f"tenants={{{SHOP},{BILLING}}}")
# The rig's API server (1.37) serves MutatingAdmissionPolicy, which helm finds there at install:
# `helm template` is told (SERVES_MUTATING_POLICIES) to render what `helm install` installs.
UPGRADE_VALUES = ("--set", f"tenants={{{SHOP}}}", "--set", "replicas=3", "--set", "image.operator.tag=0.2.0",
                  "--set", "grafanaDashboard.enabled=true")


def as_list(objects: list[dict]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})


@pytest.fixture(scope="module")
def cluster(rig):
    """The release's namespace as docs/install.md creates it (manifests/base/namespace.yaml) and the
    tenant namespaces. In a session where other modules applied the kustomize base, its objects
    would be refused by helm (not the release's): they are deleted first, so the install is a first
    install, and the local overlay is applied again after, leaving the cluster as it was found."""
    rig.kubectl("apply", "-f", str(ROOT / "manifests" / "base" / "namespace.yaml"))
    for namespace in (SHOP, BILLING, NOT_ONBOARDED):
        rig.kubectl("create", "namespace", namespace, check=False)
    had_base = rig.kubectl("get", "clusterrole", "retex-operator", check=False).returncode == 0
    everything = template("--set", f"tenants={{{SHOP},{BILLING}}}", "--set", "grafanaDashboard.enabled=true", *SERVES_MUTATING_POLICIES)
    found = [o for o in everything if o["kind"] != "TaskPolicy"]  # the tenant namespaces are new
    rig.kubectl("delete", "--ignore-not-found", "-f", "-", input=as_list(found))
    yield rig
    for namespace in (SHOP, BILLING, NOT_ONBOARDED):
        discard_namespace(rig.kubectl, namespace)
    if had_base:
        rig.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(ROOT / "manifests" / "overlays" / "local"))


@pytest.fixture(autouse=True)
def no_release_after(cluster):
    """A test that failed half-way leaves no release behind for the next one."""
    yield
    run_helm("uninstall", RELEASE, "-n", NAMESPACE, "--ignore-not-found", kubeconfig=cluster.kubeconfig, check=False)


def helm(rig, *args: str):
    return run_helm(*args, kubeconfig=rig.kubeconfig)


def present(rig, objects: list[dict]) -> list[str]:
    """Which of `objects` the API server has, as kind/name."""
    return rig.kubectl("get", "--ignore-not-found", "-o", "name", "-f", "-", input=as_list(objects)).stdout.split()


def task_admission(rig, namespace: str) -> str:
    """The API server's answer to a Task created in `namespace` (a dry run): '' when accepted."""
    answer = dry_run_task(rig.kubectl, namespace, "chart-probe")
    return "" if answer.returncode == 0 else answer.stderr.strip()


def test_install_upgrade_uninstall(cluster):
    rig = cluster
    # Install: the CRDs from crds/, then every templated object, recorded as revision 1.
    helm(rig, "install", RELEASE, str(CHART), "-n", NAMESPACE, *INSTALL_VALUES)
    for crd in CRDS:
        wait_established(rig.kubectl, crd)
    installed = template(*INSTALL_VALUES, *SERVES_MUTATING_POLICIES)
    assert {"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"} <= {o["kind"] for o in installed}
    assert len(present(rig, installed)) == len(installed), set(
        f"{o['kind'].lower()}/{o['metadata']['name']}" for o in installed) - set(present(rig, installed))
    deployment = json.loads(rig.kubectl("get", "-n", NAMESPACE, "deployment", "retex-operator", "-o", "json").stdout)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "retex-operator:0.1.0"
    [release] = json.loads(helm(rig, "list", "-n", NAMESPACE, "-o", "json").stdout)
    assert (release["name"], release["status"], release["revision"]) == (RELEASE, "deployed", "1")
    # The installed admission policy judges Tasks by the tenant's TaskPolicy from the chart (the
    # API server picks both up a moment after they are created: refused first, then accepted).
    def refused_in(namespace):
        answer = task_admission(rig, namespace)
        return NO_TASK_POLICY in answer, answer[-200:] or "accepted"

    def accepted_in(namespace):
        answer = task_admission(rig, namespace)
        return answer == "", answer[-200:]
    wait_for("a Task refused where no TaskPolicy is", lambda: refused_in(NOT_ONBOARDED), 30)
    wait_for("a Task accepted in the onboarded namespace", lambda: accepted_in(SHOP), 30)

    # Upgrade with changed values: the objects change, billing's onboarding goes, the dashboard comes.
    helm(rig, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *UPGRADE_VALUES)
    deployment = json.loads(rig.kubectl("get", "-n", NAMESPACE, "deployment", "retex-operator", "-o", "json").stdout)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "retex-operator:0.2.0"
    billing = [o for o in installed if o["metadata"].get("namespace") == BILLING]
    assert len(billing) == 6 and present(rig, billing) == []
    assert present(rig, [o for o in template(*UPGRADE_VALUES) if o["kind"] == "ConfigMap"]) == [
        "configmap/retex-grafana-dashboard"]
    history = json.loads(helm(rig, "history", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "deployed")]

    # Uninstall: every object of the release gone; the CRDs (and so every Task) kept.
    upgraded = template(*UPGRADE_VALUES, *SERVES_MUTATING_POLICIES)
    helm(rig, "uninstall", RELEASE, "-n", NAMESPACE)
    wait_for("the release's objects deleted", lambda: (present(rig, upgraded) == [], present(rig, upgraded)), 30)
    assert rig.kubectl("get", "crd", *CRDS, "-o", "name").stdout.split() == [f"customresourcedefinition.apiextensions.k8s.io/{c}"
                                                                            for c in CRDS]
    assert json.loads(helm(rig, "list", "-n", NAMESPACE, "-o", "json").stdout) == []


def test_helm_template_is_accepted_by_the_api_server_dry_run(cluster):
    """`helm template | kubectl apply --dry-run=server`, every value that adds objects on (but the
    PodMonitor: the rig has no Prometheus operator CRDs). The CRDs are applied for real first, as
    helm install does before the templates."""
    rig = cluster
    rig.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    for crd in CRDS:
        wait_established(rig.kubectl, crd)
    rendered = run_helm("template", RELEASE, str(CHART), "-n", NAMESPACE, "--set", f"tenants={{{SHOP},{BILLING}}}",
                        "--set", "grafanaDashboard.enabled=true", "--set", "database.dsn=host=db sslmode=verify-full",
                        "--set", f"watchNamespaces={{{SHOP}}}", *SERVES_MUTATING_POLICIES).stdout
    result = rig.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered, check=False)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    assert "deployment.apps/retex-operator created (server dry run)" in result.stdout
