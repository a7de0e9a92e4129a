"""The operator's finalizer on each Task from its creation (manifests/finalizer-at-create; the chart
installs it where the API server serves MutatingAdmissionPolicy, Kubernetes 1.36 and later): kopf
then has no finalizer to add, so it makes one PATCH fewer and runs the Task's first handler on the
Task's first watch event (docs/benchmarks.md). The policy here is the chart's, bound to the test's
namespace as `watchNamespaces` binds it. The suite's other tests run without it: the path of an
older cluster, where kopf adds the finalizer itself."""

from __future__ import annotations

import json

import pytest
import yaml
from kubernetes import client, watch

from e2e.helm import SERVES_MUTATING_POLICIES, template
from e2e.system import (
    FINALIZER,
    apply_finalizer_policy,
    discard_namespace,
    prepare_namespace,
    task_manifest,
    unbind_finalizer_policy,
)

ONE_STEP = [{"name": "only", "exec": {"command": ["true"]}}]
HANDLED = "kopf.retex.dev/last-handled-configuration"  # kopf's diff base: what it handled


@pytest.fixture
def charts_policy(retex):
    """The chart's finalizer policy and binding with watchNamespaces = the test's namespace."""
    objects = template(*SERVES_MUTATING_POLICIES, "--set", f"watchNamespaces={{{retex.namespace}}}",
                       "--show-only", "templates/task-finalizer-policy.yaml")
    name = apply_finalizer_policy(retex.rig.kubectl, objects, retex.namespace)
    yield
    unbind_finalizer_policy(retex.rig.kubectl, name)


def versions_since(rig, namespace: str, resource_version: str, name: str, until) -> list[dict]:
    """Every version of Task `name` the API server stored after `resource_version`, in order, up to
    the first for which `until(version)` holds (a watch from that version replays them all)."""
    seen = []
    with rig.api_client() as api:
        stream = watch.Watch()
        for event in stream.stream(client.CustomObjectsApi(api).list_namespaced_custom_object, "retex.dev", "v1alpha1",
                                   namespace, "tasks", field_selector=f"metadata.name={name}",
                                   resource_version=resource_version, timeout_seconds=30):
            seen.append(event["object"])
            if until(event["object"]):
                stream.stop()
    return seen


def succeeded_and_handled(version: dict) -> bool:
    """The Task succeeded, and kopf recorded it handled its creation (the two race)."""
    return ((version.get("status") or {}).get("phase") == "Succeeded"
            and HANDLED in (version["metadata"].get("annotations") or {}))


def metadata_writes(versions: list[dict]) -> list[dict]:
    """The versions whose finalizers, annotations or labels differ from the version before."""
    def shown(version):
        meta = version["metadata"]
        return meta.get("finalizers"), meta.get("annotations"), meta.get("labels")
    return [later for earlier, later in zip(versions, versions[1:], strict=False) if shown(earlier) != shown(later)]


def test_a_task_created_under_the_policy_runs_with_one_metadata_write_of_the_operators(retex, charts_policy):
    created = json.loads(retex.kubectl("create", "-o", "json", "-f", "-", input=task_manifest("at-once", ONE_STEP)).stdout)
    assert created["metadata"].get("finalizers") == [FINALIZER]
    versions = [created, *versions_since(retex.rig, retex.namespace, created["metadata"]["resourceVersion"], "at-once",
                                         succeeded_and_handled)]
    assert succeeded_and_handled(versions[-1]), retex.operator.log_tail()
    # kopf's record of what it handled, and no PATCH adding the finalizer (without the policy: two).
    writes = metadata_writes(versions)
    assert [sorted(w["metadata"].get("annotations") or {}) for w in writes] == [[HANDLED]], [
        (v["metadata"]["resourceVersion"], v["metadata"].get("finalizers"), sorted(v["metadata"].get("annotations") or {}),
         (v.get("status") or {}).get("phase")) for v in versions]
    assert [v["metadata"].get("finalizers") for v in versions] == [[FINALIZER]] * len(versions)
    # The operator still takes the finalizer off: the delete completes (kubectl waits for the Task to go).
    retex.kubectl("delete", "task", "at-once", "--timeout=60s")


def test_the_policy_keeps_the_finalizers_a_task_is_created_with(retex, charts_policy):
    manifest = yaml.safe_load(task_manifest("with-its-own", ONE_STEP))
    manifest["metadata"]["finalizers"] = ["example.com/keep"]
    created = json.loads(retex.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                       input=json.dumps(manifest)).stdout)
    assert sorted(created["metadata"]["finalizers"]) == ["example.com/keep", FINALIZER]


def test_a_task_in_a_namespace_the_binding_leaves_out_gets_no_finalizer_from_it(retex, charts_policy):
    other = f"{retex.namespace}-unbound"
    prepare_namespace(retex.rig.kubectl, other)
    try:
        created = json.loads(retex.rig.kubectl("create", "-n", other, "-o", "json", "-f", "-",
                                               input=task_manifest("elsewhere", ONE_STEP)).stdout)
        # No operator serves this namespace: a finalizer here would hold the Task's deletion for good.
        assert not created["metadata"].get("finalizers")
    finally:
        discard_namespace(retex.rig.kubectl, other)
