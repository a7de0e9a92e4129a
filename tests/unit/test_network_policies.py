"""The NetworkPolicies shipped with retex say what docs/security.md says they do (issue 14, item 6).

The rig has no CNI that enforces NetworkPolicy, so what is proved here is the object: which pods
it selects (the worker pods retex.kube.objects builds, the operator pod) and which egress and
ingress its rules allow. tests/cluster/test_manifests.py shows the API server accepts them.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import yaml

from retex.api import TaskSpec
from retex.kube.objects import WorkerDefaults, build_job

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
METADATA_ADDRESS = ipaddress.ip_address("169.254.169.254")
LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")


def manifest(path: str) -> dict:
    return yaml.safe_load((MANIFESTS / path).read_text())


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def worker_pod_labels() -> dict:
    job = build_job(task_name="t", task_uid="0b7c5f0e-8a1d-4e52-9d3c-1f2e3d4c5b6a", namespace="shop", epoch=1,
                    spec=TaskSpec.model_validate({"steps": [{"name": "s", "exec": {"command": ["true"]}}]}),
                    defaults=WorkerDefaults(image="w", service_account="retex-worker", ledger_url="http://l"))
    return job["spec"]["template"]["metadata"]["labels"]


def operator_pod_labels() -> dict:
    return manifest("base/operator-deployment.yaml")["spec"]["template"]["metadata"]["labels"]


def ports(rule: dict) -> set[tuple[str, int]]:
    return {(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports") or ()}


def test_the_tenant_onboarding_ships_the_worker_egress_policy():
    assert "worker-networkpolicy.yaml" in manifest("tenant/kustomization.yaml")["resources"]
    assert "ledger-networkpolicy.yaml" in manifest("base/kustomization.yaml")["resources"]


def test_worker_pods_may_reach_dns_the_ledger_endpoint_and_the_api_server_ports_only():
    policy = manifest("tenant/worker-networkpolicy.yaml")
    assert selects(policy["spec"]["podSelector"], worker_pod_labels())
    assert policy["spec"]["policyTypes"] == ["Egress"]  # selected pods: everything else is denied
    dns, ledger, api_server = policy["spec"]["egress"]
    assert ports(dns) == {("UDP", 53), ("TCP", 53)}
    assert dns["to"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    # The ledger endpoint: the pods behind Service retex-ledger, in retex-system, on its target port.
    service = manifest("base/ledger-service.yaml")
    (peer,) = ledger["to"]
    assert selects(peer["podSelector"], operator_pod_labels())
    assert peer["podSelector"]["matchLabels"] == service["spec"]["selector"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "retex-system"}}
    container = manifest("base/operator-deployment.yaml")["spec"]["template"]["spec"]["containers"][0]
    ledger_port = next(p["containerPort"] for p in container["ports"] if p["name"] == service["spec"]["ports"][0]["targetPort"])
    assert ports(ledger) == {("TCP", ledger_port)}
    assert ports(api_server) == {("TCP", 443), ("TCP", 6443)}


def test_no_worker_egress_rule_reaches_link_local_addresses():
    """Every rule names its peers (an empty `to` would allow any address), and every ipBlock keeps
    169.254.0.0/16 (cloud metadata at 169.254.169.254) out."""
    for rule in manifest("tenant/worker-networkpolicy.yaml")["spec"]["egress"]:
        assert rule.get("to"), rule
        assert rule.get("ports"), rule  # no rule opens every port
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block is None:
                assert peer.get("podSelector") is not None, peer  # pods, never whole namespaces' hosts
                continue
            excepted = [ipaddress.ip_network(cidr) for cidr in block.get("except") or ()]
            if METADATA_ADDRESS in ipaddress.ip_network(block["cidr"]):
                assert any(LINK_LOCAL.subnet_of(e) for e in excepted), block


def test_the_ledger_endpoint_admits_only_worker_pods():
    policy = manifest("base/ledger-networkpolicy.yaml")
    assert selects(policy["spec"]["podSelector"], operator_pod_labels())
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        if ("TCP", 8081) in ports(rule):
            (peer,) = rule["from"]
            assert selects(peer["podSelector"], worker_pod_labels()) and peer["podSelector"]["matchLabels"]
        else:
            assert ports(rule) == {("TCP", 8080), ("TCP", 9090)}  # health and metrics
