"""e2e/rig/external.py without a cluster: how the cluster is chosen from the environment (the
tests' `rig` fixture and `make bench` alike), and what names a kind pod's processes for its nemeses."""

from types import SimpleNamespace

from e2e.rig import external
from e2e.rig.external import pod_cgroup_patterns


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
