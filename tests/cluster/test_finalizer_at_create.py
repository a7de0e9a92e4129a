"""The operator's finalizer on each Task from its creation (manifests/finalizer-at-create; the chart
installs it where the API server serves MutatingAdmissionPolicy, Kubernetes 1.36 and later): kopf
then has no finalizer to add, so it makes one PATCH fewer and runs the Task's first handler on the
Task's first watch event (docs/benchmarks.md). The suite's other tests run without it: the path of
an older cluster, where kopf adds the finalizer itself."""

from __future__ import annotations

import json

from kubernetes import client, watch

from e2e.system import (
    FINALIZER,
    bind_finalizer_policy,
    discard_namespace,
    prepare_namespace,
    task_manifest,
    unbind_finalizer_policy,
)

ONE_STEP = [{"name": "only", "exec": {"command": ["true"]}}]


def versions_since(rig, namespace: str, resource_version: str, name: str, until_phase: str) -> list[dict]:
    """Every version of Task `name` the API server stored after `resource_version`, in order, up to
    the first in `until_phase` (a watch from that version replays them all)."""
    seen = []
    with rig.api_client() as api:
        stream = watch.Watch()
        for event in stream.stream(client.CustomObjectsApi(api).list_namespaced_custom_object, "retex.dev", "v1alpha1",
                                   namespace, "tasks", field_selector=f"metadata.name={name}",
                                   resource_version=resource_version, timeout_seconds=30):
            seen.append(event["object"])
            if (event["object"].get("status") or {}).get("phase") == until_phase:
                stream.stop()
    return seen


def test_a_task_created_where_the_policy_is_bound_has_the_finalizer_in_every_version_and_runs(retex):
    binding = bind_finalizer_policy(retex.rig.kubectl, retex.namespace)
    try:
        before = json.loads(retex.kubectl("get", "tasks", "-o", "json").stdout)["metadata"]["resourceVersion"]
        created = json.loads(retex.kubectl("create", "-o", "json", "-f", "-",
                                           input=task_manifest("at-once", ONE_STEP)).stdout)
        assert created["metadata"].get("finalizers") == [FINALIZER]
        versions = versions_since(retex.rig, retex.namespace, before, "at-once", "Succeeded")
        assert (versions[-1].get("status") or {}).get("phase") == "Succeeded", retex.operator.log_tail()
        # The operator never had a finalizer to add: each version it wrote carries the one admission gave.
        assert [v["metadata"].get("finalizers") for v in versions] == [[FINALIZER]] * len(versions)
        # ...and it still takes the finalizer off: the delete completes (kubectl waits for the Task to go).
        retex.kubectl("delete", "task", "at-once", "--timeout=60s")
    finally:
        unbind_finalizer_policy(retex.rig.kubectl, binding)


def test_a_task_in_a_namespace_the_binding_leaves_out_gets_no_finalizer_from_it(retex):
    binding = bind_finalizer_policy(retex.rig.kubectl, retex.namespace)
    other = f"{retex.namespace}-unbound"
    prepare_namespace(retex.rig.kubectl, other)
    try:
        created = json.loads(retex.rig.kubectl("create", "-n", other, "-o", "json", "-f", "-",
                                               input=task_manifest("elsewhere", ONE_STEP)).stdout)
        # No operator serves this namespace: a finalizer here would hold the Task's deletion for good.
        assert not created["metadata"].get("finalizers")
    finally:
        discard_namespace(retex.rig.kubectl, other)
        unbind_finalizer_policy(retex.rig.kubectl, binding)
