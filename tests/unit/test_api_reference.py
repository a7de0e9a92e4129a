"""docs/reference.md is what `make reference` writes from the models and the TaskPolicy CRD."""

from pathlib import Path

from retex.api import crd
from retex.api.reference import render, taskpolicy_crd

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference.md"
TASKPOLICY = ROOT / "manifests" / "base" / "task-policy.yaml"


def field_paths(node: dict, path: str) -> set[str]:
    paths = {path}
    if node.get("type") == "array" and "items" in node:
        node, path = node["items"], f"{path}[]"
    elif isinstance(node.get("additionalProperties"), dict):
        node, path = node["additionalProperties"], f"{path}{{}}"
    for name, field in node.get("properties", {}).items():
        paths |= field_paths(field, f"{path}.{name}")
    return paths


def test_the_committed_reference_is_what_make_reference_writes():
    assert REFERENCE.read_text() == render(taskpolicy_crd(TASKPOLICY)), (
        "docs/reference.md is stale: run `make reference` and commit it")


def test_every_field_of_the_task_and_the_taskpolicy_has_a_row():
    page = render(taskpolicy_crd(TASKPOLICY))
    task = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    (version,) = taskpolicy_crd(TASKPOLICY)["spec"]["versions"]
    policy = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    expected = field_paths(task["spec"], "spec") | field_paths(task["status"], "status") | field_paths(policy, "spec")
    assert len(expected) > 100
    assert sorted(path for path in expected if f"| `{path}` |" not in page) == []
