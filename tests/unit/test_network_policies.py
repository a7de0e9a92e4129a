"""The NetworkPolicies shipped with retex say what docs/security.md says they do.

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
# Link-local ranges (cloud metadata at 169.254.169.254) and metadata addresses outside them.
FORBIDDEN_NETWORKS = [ipaddress.ip_network(n) for n in
                      ("169.254.0.0/16", "100.100.100.200/32", "fe80::/10", "fd00:ec2::254/128")]


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
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                          "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
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
    """Every rule names its peers (an empty `to` would allow any address) and, for pods, their
    namespace; every ipBlock keeps the link-local ranges and metadata addresses out, IPv4 and IPv6."""
    for rule in manifest("tenant/worker-networkpolicy.yaml")["spec"]["egress"]:
        assert rule.get("to"), rule
        assert rule.get("ports"), rule  # no rule opens every port
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block is None:
                assert peer.get("podSelector") is not None, peer  # pods, never whole namespaces' hosts
                assert peer.get("namespaceSelector", {}).get("matchLabels"), peer  # of a named namespace
                continue
            network = ipaddress.ip_network(block["cidr"])
            excepted = [ipaddress.ip_network(cidr) for cidr in block.get("except") or ()]
            for forbidden in FORBIDDEN_NETWORKS:
                if forbidden.version == network.version and network.overlaps(forbidden):
                    assert not network.subnet_of(forbidden), block
                    assert any(forbidden.subnet_of(e) for e in excepted if e.version == forbidden.version), block


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
