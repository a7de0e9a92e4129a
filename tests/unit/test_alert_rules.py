"""The alert rules ship twice, as CloudNativePG ships its own: a plain Prometheus rules file and a
PrometheusRule for the Prometheus operator. They carry the same groups, query only what the
operator exports, and the PrometheusRule stays out of the base (a cluster without its CRD)."""

import re
from pathlib import Path

import yaml

from tests.unit.test_dashboard import exported_sample_names

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
RULES_FILE = MANIFESTS / "monitoring" / "retex-alerts.rules.yaml"
PROMETHEUS_RULE = MANIFESTS / "monitoring" / "prometheusrule.yaml"


def rules() -> dict:
    return yaml.safe_load(RULES_FILE.read_text())


def test_the_prometheusrule_carries_exactly_the_groups_of_the_rules_file():
    prometheus_rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (prometheus_rule["apiVersion"], prometheus_rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert prometheus_rule["metadata"]["namespace"] == "retex-system"
    assert prometheus_rule["spec"] == rules(), f"{PROMETHEUS_RULE.name} drifted from {RULES_FILE.name}: copy its groups"


def test_every_alert_queries_only_metrics_the_operator_exports():
    alerts = [rule for group in rules()["groups"] for rule in group["rules"]]
    assert alerts and all("alert" in rule and rule["labels"]["severity"] in ("warning", "critical") for rule in alerts)
    queried = {name for rule in alerts for name in re.findall(r"\b(retex_[a-z_]+)", rule["expr"])}
    assert queried - exported_sample_names() == set()


def test_only_the_optional_monitoring_kustomization_lists_the_prometheusrule():
    monitoring = yaml.safe_load((MANIFESTS / "monitoring" / "kustomization.yaml").read_text())
    assert PROMETHEUS_RULE.name in monitoring["resources"]
    for kustomization in MANIFESTS.glob("**/kustomization.yaml"):
        if kustomization.parent.name != "monitoring":
            resources = yaml.safe_load(kustomization.read_text()).get("resources", [])
            assert not any("monitoring" in resource for resource in resources), kustomization
