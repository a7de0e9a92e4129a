"""The status mirror's resync lists every Task in the cluster: page by page (`limit` and
`continue`), so the operator never holds all of them, nor the client's decoded copy, at once
(with 5,000 Tasks one unpaged LIST made the operator's memory spike)."""

from __future__ import annotations

from kubernetes import client

from e2e.system import discard_namespace, install_crd, prepare_namespace, task_manifest
from retex.kube.operator_calls import KubeCalls

NAMESPACE = "paging"


def test_the_task_list_is_read_in_pages_and_every_task_is_seen_once(rig, kube, monkeypatch):
    install_crd(rig.kubectl)
    prepare_namespace(rig.kubectl, NAMESPACE)  # Tasks are admitted only where a TaskPolicy is
    names = [f"page-{n}" for n in range(8)]
    for name in names:
        rig.kubectl("apply", "-n", NAMESPACE, "-f", "-",
                    input=task_manifest(name, [{"name": "s", "exec": {"command": ["true"]}}]))
    requests: list[dict] = []
    real = client.CustomObjectsApi.list_cluster_custom_object

    def spy(self, *args, **kwargs):
        requests.append({k: kwargs.get(k) for k in ("limit", "_continue")})
        return real(self, *args, **kwargs)

    monkeypatch.setattr(client.CustomObjectsApi, "list_cluster_custom_object", spy)
    try:
        seen = [(t["metadata"]["namespace"], t["metadata"]["name"])
                for t in KubeCalls(kube, instance="test", request_timeout=5.0, list_page_size=3).list_tasks()]
        ours = [name for namespace, name in seen if namespace == NAMESPACE]
        assert sorted(ours) == names, "every Task once"
        assert len(seen) == len(set(seen))
        assert len(requests) >= 3 and all(r["limit"] == 3 for r in requests), requests
        assert requests[0]["_continue"] is None and all(r["_continue"] for r in requests[1:]), requests
    finally:
        discard_namespace(rig.kubectl, NAMESPACE)
