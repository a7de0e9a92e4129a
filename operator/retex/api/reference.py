"""docs/reference.md, generated from the CRDs' schemas: `python -m retex.api.reference TASKPOLICY_CRD`.

The Task's schema is built from the models (retex.api.crd); the TaskPolicy's is read from its CRD
file (manifests/base/task-policy.yaml, which has no model). Each field is one row: its path, type,
default, limits (bounds, enum, pattern, list semantics, CEL rules' messages) and description.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from retex.api import crd, models

_HEADER = """# API reference (generated)

Every field of the Task's spec and status and of the TaskPolicy's spec, as the CRDs declare them:
type, default, limits and description. Generated from the models and the TaskPolicy CRD by `make
reference` (`python -m retex.api.reference manifests/base/task-policy.yaml`); do not edit, a test
fails when this page is stale. [api.md](api.md) explains the API with examples; this page lists it.

A path's `[]` is a list item, `{}` a map value. Limits: `value` bounds a number, `len` a string,
`items` a list, `keys` a map, `each` every item or value of a list or map; "rule" is a CEL rule the
API server enforces, by its message.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _text(text: str) -> str:
    """Prose in a cell: no markup of its own (a backtick or an angle bracket is shown as written)."""
    return _cell(text).replace("`", "\\`").replace("<", "&lt;")


def _code(value: Any) -> str:
    shown = _cell(value if isinstance(value, str) and value else json.dumps(value))
    return f"`` {shown} ``" if "`" in shown else f"`{shown}`"


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = node.get("type", "any JSON")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object" and "additionalProperties" in node:
        return f"map of {_type(node['additionalProperties'])}"
    if kind == "object" and "properties" not in node and node.get("x-kubernetes-preserve-unknown-fields"):
        return "JSON object"
    if node.get("format") == "date-time":
        return "timestamp (RFC 3339)"
    return str(kind)


def _bound(low: Any, high: Any) -> str:
    if low is not None and high is not None:
        return f"{low}–{high}"
    return f"≥ {low}" if low is not None else f"≤ {high}"


def _limits(node: dict[str, Any], required: bool) -> list[str]:
    limits = ["required"] if required else []
    for low, high, what in (("minimum", "maximum", "value"), ("minLength", "maxLength", "len"),
                            ("minItems", "maxItems", "items"), ("minProperties", "maxProperties", "keys")):
        if node.get(low) is not None or node.get(high) is not None:
            limits.append(f"{what} {_bound(node.get(low), node.get(high))}")
    if "enum" in node:
        limits.append("one of " + ", ".join(_code(value) for value in node["enum"]))
    if "pattern" in node:
        limits.append(f"pattern {_code(node['pattern'])}")
    if node.get("x-kubernetes-list-type") == "map":
        limits.append("unique by " + ", ".join(_code(key) for key in node.get("x-kubernetes-list-map-keys", [])))
    limits += [f"rule: {_text(rule['message'])}" for rule in node.get("x-kubernetes-validations", [])
               if "fieldPath" not in rule]
    # A list's or map's scalar values have no row of their own: their limits are shown here.
    for inner in (node.get("items"), node.get("additionalProperties")):
        if isinstance(inner, dict) and "properties" not in inner and (each := _limits(inner, False)):
            limits.append("each: " + ", ".join(each))
    return limits


def _rows(node: dict[str, Any], path: str, required: bool, field_rules: dict[str, list[str]]) -> list[str]:
    """One row for `node` at `path` (none for the root), then its fields, depth first."""
    rows = []
    if path:
        limits = _limits(node, required) + field_rules.get(path, [])
        default = _code(node["default"]) if "default" in node else ""
        rows.append(f"| `{path}` | {_type(node)} | {default} | {'; '.join(limits)} | "
                    f"{_text(node.get('description', ''))} |")
    # Rules on an object that name one of its fields (spec's immutability) are shown on that field.
    rules = dict(field_rules)
    for rule in node.get("x-kubernetes-validations", []):
        if "fieldPath" in rule:
            rules.setdefault(f"{path}{rule['fieldPath']}", []).append(f"rule: {_text(rule['message'])}")
    if node.get("type") == "array" and "items" in node:
        node, path = node["items"], f"{path}[]"
    elif "additionalProperties" in node and isinstance(node["additionalProperties"], dict):
        node, path = node["additionalProperties"], f"{path}{{}}"
    needed = set(node.get("required", []))
    for name, field in node.get("properties", {}).items():
        rows += _rows(field, f"{path}.{name}" if path else name, name in needed, rules)
    return rows


def _table(title: str, description: str, schema: dict[str, Any], root: str) -> str:
    rows = _rows(schema, root, False, {})
    return "\n".join([f"## {title}", "", " ".join(description.split()), "",
                      "| field | type | default | limits | description |", "|---|---|---|---|---|", *rows, ""])


def render(taskpolicy_crd: dict[str, Any]) -> str:
    task = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (policy_version,) = taskpolicy_crd["spec"]["versions"]
    policy = policy_version["schema"]["openAPIV3Schema"]
    return "\n".join([
        _HEADER,
        _table(f"Task `spec` ({models.API_VERSION})", task["description"], task["properties"]["spec"], "spec"),
        _table("Task `status`", "Written by the operator only.", task["properties"]["status"], "status"),
        _table(f"TaskPolicy `spec` ({taskpolicy_crd['spec']['group']}/{policy_version['name']})",
               policy.get("description", ""), policy["properties"]["spec"], "spec"),
    ])


def taskpolicy_crd(path: Path) -> dict[str, Any]:
    """The TaskPolicy CustomResourceDefinition among the documents of `path`."""
    (found,) = [doc for doc in yaml.safe_load_all(path.read_text())
                if doc and doc.get("kind") == "CustomResourceDefinition" and doc["spec"]["names"]["kind"] == "TaskPolicy"]
    return dict(found)


if __name__ == "__main__":
    sys.stdout.write(render(taskpolicy_crd(Path(sys.argv[1]))))
