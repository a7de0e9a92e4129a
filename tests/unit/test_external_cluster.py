"""e2e/rig/external.py without a cluster: how the cluster is chosen from the environment (the
tests' `rig` fixture and `make bench` alike), what names a kind pod's processes for its nemeses,
and the rules a kind node's partition sets and its heal deletes."""

import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from e2e.rig import external
from e2e.rig.external import HEAL_SCRIPT, PARTITION_SCRIPT, PARTITION_TAG, pod_cgroup_patterns


def test_the_cluster_is_chosen_as_the_tests_choose_it(monkeypatch):
    made = []
    monkeypatch.setattr(external, "ExternalCluster", lambda path: made.append(("external", str(path))) or "external")
    monkeypatch.setattr(external, "KindCluster", lambda path: made.append(("kind", str(path))) or "kind")
    monkeypatch.delenv("RETEX_KUBECONFIG", raising=False)
    monkeypatch.delenv("RETEX_KIND_CLUSTER", raising=False)
    assert external.from_environment() is None
    monkeypatch.setenv("RETEX_KUBECONFIG", "/tmp/kc")
    assert external.from_environment() == "external"
    monkeypatch.setenv("RETEX_KIND_CLUSTER", "retex-e2e")
    assert external.from_environment() == "kind"
    assert made == [("external", "/tmp/kc"), ("kind", "/tmp/kc")]


def _pod(uid, *container_ids):
    statuses = [SimpleNamespace(container_id=c) for c in container_ids]
    return SimpleNamespace(metadata=SimpleNamespace(uid=uid), status=SimpleNamespace(container_statuses=statuses))


def test_a_kind_pod_is_killed_by_its_containers_ids_and_paused_by_its_cgroup():
    pod = _pod("1a-2b", "containerd://abc123", None)  # the second container has not started
    assert pod_cgroup_patterns(pod, containers_only=True) == ["abc123"]
    assert pod_cgroup_patterns(pod) == ["pod1a-2b", "pod1a_2b"]
    assert pod_cgroup_patterns(_pod("1a-2b"), containers_only=True) == []


# A network namespace of the test's own, shaped as a kind node's where it matters: a link, v0,
# carries the default route, and a rule of someone else's heads INPUT, its comment beginning as
# the partition's tag does.
_FOREIGN_RULE = f"-A INPUT -p tcp -m tcp --dport 10250 -m comment --comment {PARTITION_TAG}-kept -j ACCEPT"
_NODE_LIKE = ("ip link add v0 type veth peer name v1 && ip addr add 10.9.9.2/24 dev v0 && ip link set v0 up "
              f"&& ip route add default via 10.9.9.1 && iptables {_FOREIGN_RULE}")


def _rules_after(*scripts: str) -> tuple[list[str], dict[str, list[str]]]:
    """Each script's output, run one after another by sh in a fresh node-like namespace, and the
    rules each family (iptables, and ip6tables where the namespace has IPv6) holds after them."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("unshare", "ip", "iptables", "ip6tables")):
        pytest.skip("needs root, unshare, ip and iptables: the scripts run in a network namespace of their own")
    program = (f"{{ {_NODE_LIKE}; }} >&2 || exit 97; "
               'for script in "$@"; do sh -c "$script" || exit 1; echo ===; done; '
               "iptables -S; echo ===; test -e /proc/net/if_inet6 && ip6tables -S; true")
    done = subprocess.run(["unshare", "--net", "sh", "-c", program, "sh", *scripts],
                          capture_output=True, text=True, timeout=60)
    if done.returncode == 97:
        pytest.skip(f"no node-like network namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    *outputs, ipv4, ipv6 = done.stdout.split("===\n")
    rules = {"iptables": ipv4.splitlines()} | ({"ip6tables": ipv6.splitlines()} if ipv6 else {})
    return [output.strip() for output in outputs], rules


def _drops(chain: str, direction: str) -> str:
    return f"-A {chain} {direction} v0 -m comment --comment {PARTITION_TAG} -j DROP"


def test_a_partition_drops_everything_through_the_default_routes_link_ahead_of_every_other_rule_once():
    outputs, rules = _rules_after(PARTITION_SCRIPT, PARTITION_SCRIPT)  # a retried partition
    assert outputs == ["v0", "v0"]
    for family, held in rules.items():
        chains = {chain: [rule for rule in held if rule.startswith(f"-A {chain} ")] for chain in ("INPUT", "OUTPUT", "FORWARD")}
        assert chains["INPUT"][0] == _drops("INPUT", "-i"), (family, held)
        assert chains["OUTPUT"] == [_drops("OUTPUT", "-o")], (family, held)
        assert sorted(chains["FORWARD"]) == sorted([_drops("FORWARD", "-i"), _drops("FORWARD", "-o")]), (family, held)
        assert sum(f"--comment {PARTITION_TAG} " in rule for rule in held) == 4, (family, held)
    assert _FOREIGN_RULE in rules["iptables"]


def test_a_heal_deletes_exactly_the_partitions_rules_and_heals_a_healed_node_too():
    untouched = _rules_after()[1]
    assert _FOREIGN_RULE in untouched["iptables"], untouched
    outputs, rules = _rules_after(PARTITION_SCRIPT, HEAL_SCRIPT, HEAL_SCRIPT)
    assert outputs == ["v0", "", ""]
    assert rules == untouched
    assert _rules_after(HEAL_SCRIPT)[1] == untouched
