"""The generated CRD: committed file up to date, structural, documented, defaults equal to the model's."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from retex.api import TaskSpec, crd

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "tasks.retex.dev.yaml"


def openapi_schema() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, prop in node.get("properties", {}).items():
        yield from walk(prop, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_is_what_the_models_generate():
    assert CRD_FILE.read_text() == crd.render_crd(), "crds/ is stale: run `make crds` and commit the result"


def test_committed_crd_parses_to_the_generated_object():
    assert yaml.safe_load(CRD_FILE.read_text()) == crd.build_crd()


def test_schema_is_structural():
    for path, node in walk(openapi_schema()):
        assert "$ref" not in node and "definitions" not in node and "$defs" not in node, path
        assert not {"allOf", "oneOf", "not"} & node.keys(), path
        free = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
        assert "type" in node or free, f"{path} has no type"
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        assert "nullable" not in node and "uniqueItems" not in node, path
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), f"{path}: array without items"


def test_every_spec_and_status_field_has_a_description():
    schema = openapi_schema()
    for part in ("spec", "status"):
        for path, node in walk(schema["properties"][part], part):
            if path.endswith("{}") or (path.endswith("[]") and node.get("type") != "object"):
                continue  # map values and scalar list items are described by their field
            assert node.get("description"), f"{path} has no description"


def test_every_cel_rule_has_a_one_line_message():
    rules = [rule for _, node in walk(openapi_schema()) for rule in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 10
    for rule in rules:
        assert rule["message"] and "\n" not in rule["message"], rule


def test_every_list_string_and_map_in_spec_and_status_is_bounded():
    # Unbounded lists and strings make the API server's CEL cost estimate exceed its budget.
    schema = openapi_schema()
    nodes = [*walk(schema["properties"]["spec"], "spec"), *walk(schema["properties"]["status"], "status")]
    for path, node in nodes:
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path} has no maxItems"
        if node.get("type") == "string" and "enum" not in node and "format" not in node:
            assert "maxLength" in node, f"{path} has no maxLength"
        if node.get("type") == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, f"{path} has no maxProperties"


def apply_schema_defaults(value: Any, node: dict[str, Any]) -> Any:
    """Structural defaulting as the API server does it: a missing field with a default gets a copy
    of it, and defaulted objects are defaulted in turn."""
    if isinstance(value, dict) and "properties" in node:
        for name, prop in node["properties"].items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = apply_schema_defaults(value[name], prop)
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        value = [apply_schema_defaults(item, node["items"]) for item in value]
    return value


def test_api_server_defaults_are_the_model_defaults():
    minimal = {"steps": [{"name": "ship", "exec": {"command": ["ship"], "env": [{"name": "MODE"}]}}]}
    by_schema = apply_schema_defaults(copy.deepcopy(minimal), openapi_schema()["properties"]["spec"])
    assert by_schema == TaskSpec.model_validate(minimal).to_json()
    assert by_schema["retry"] == {
        "maxAttempts": 3,
        "maxDisruptions": 10,
        "backoff": {"initialSeconds": 1, "maxSeconds": 300, "factor": 2},
        "jitter": "Full",
    }
    assert by_schema["lease"] == {"durationSeconds": 15}
    assert (by_schema["priority"], by_schema["cancel"]) == (0, False)
    assert by_schema["steps"][0]["timeoutSeconds"] == 300 and by_schema["steps"][0]["idempotent"] is False


def test_crd_names_columns_and_status_subresource():
    spec = crd.build_crd()["spec"]
    assert spec["group"] == "retex.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["shortNames"] == ["rtask"] and spec["names"]["categories"] == ["retex"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {column["name"]: column for column in version["additionalPrinterColumns"]}
    assert [name for name, column in columns.items() if not column.get("priority")] == [
        "Phase",
        "Progress",
        "Attempt",
        "Age",
    ]
    assert columns["Progress"]["jsonPath"] == ".status.progress"


def test_transition_rules_freeze_the_spec_but_cancel_and_keep_status_moving_forward():
    schema = openapi_schema()
    spec, status = schema["properties"]["spec"], schema["properties"]["status"]
    transition_rules = {
        (path, rule.get("fieldPath"), rule["message"])
        for path, node in walk(schema)
        for rule in node.get("x-kubernetes-validations", [])
        if "oldSelf" in rule["rule"]
    }
    frozen = {field.alias for field in TaskSpec.model_fields.values()} - {"cancel"}
    assert transition_rules == {
        *((".spec", f".{name}", f"{name} cannot change once the task is created (only cancel can)") for name in frozen),
        (".spec.cancel", None, "cancel cannot be undone: once true it stays true"),
        (".status", None, "status.ledgerVersion never goes backwards"),
    }
    assert {"steps", "payload", "idempotencyKey", "priority", "worker"} <= frozen
    assert spec["properties"]["steps"]["x-kubernetes-list-type"] == "atomic"
    assert status["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def test_a_condition_type_is_any_metav1_type_not_an_enum():
    # An operator that adds a condition type must not need a CRD upgrade first, and an older
    # operator must read a status a newer one wrote.
    condition_type = openapi_schema()["properties"]["status"]["properties"]["conditions"]["items"]["properties"]["type"]
    assert "enum" not in condition_type
    assert condition_type["maxLength"] == 316
    for written_later in ("Completed", "Progressing", "example.com/Audited"):
        assert re.fullmatch(condition_type["pattern"], written_later)
    assert not re.fullmatch(condition_type["pattern"], "not a type")


def test_every_cel_message_is_documented_in_docs_api_md():
    docs = (ROOT / "docs" / "api.md").read_text()
    messages = {rule["message"] for _, node in walk(openapi_schema()) for rule in node.get("x-kubernetes-validations", [])}
    frozen_field_messages = {m for m in messages if m.endswith("cannot change once the task is created (only cancel can)")}
    assert "<field> cannot change once the task is created (only cancel can)" in docs
    undocumented = {m for m in messages - frozen_field_messages if m not in docs.replace("`\\|", "`|")}
    assert not undocumented
