"""The Task CustomResourceDefinition, generated from the models: `python -m retex.api.crd`.

pydantic's JSON schema is translated into a Kubernetes structural schema: every $ref inlined,
Optional (anyOf with null) collapsed to the type itself, titles and `additionalProperties: false`
dropped (the API server refuses unknown fields by itself), descriptions folded onto one line.
Anything the translation does not understand is an error rather than a silently wrong CRD.

A field's description is the docstring under it, read from the models' source here, when the CRD
is generated (pydantic's `use_attribute_docstrings` would read it at every import: ~50 ms of CPU
in each worker pod's start, for descriptions only the CRD shows).
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from typing import Any

import yaml
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from retex.api import models

CRD_NAME = f"{models.PLURAL}.{models.GROUP}"

# Output key order, for a readable YAML file.
_KEY_ORDER = [
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "required",
    "properties",
    "additionalProperties",
    "items",
    "x-kubernetes-validations",
]
_DROPPED = {"title"}
_NULL = {"type": "null"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Merge $ref / single allOf / Optional anyOf into one node; the referring node's own keys
    (its default, its extensions) win over the referenced model's; descriptions are joined."""
    node = dict(node)
    if "$ref" in node:
        return _merge(defs[node.pop("$ref").removeprefix("#/$defs/")], node, defs)
    if "allOf" in node:
        (only,) = node.pop("allOf")
        return _merge(only, node, defs)
    if "anyOf" in node and _NULL in node["anyOf"]:
        (only,) = [option for option in node.pop("anyOf") if option != _NULL]
        return _merge(only, node, defs)
    return node


def _merge(target: dict[str, Any], referrer: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    target = _resolve(target, defs)
    merged = {**target, **referrer}
    # The field says what it is for, the model's docstring what it is: `kubectl explain` shows both.
    if "description" in target and "description" in referrer:
        merged["description"] = f"{referrer['description']} {target['description']}"
    return merged


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED or (key == "additionalProperties" and value is False):
            continue
        if key == "default" and value is None:
            continue
        if key == "description":
            value = " ".join(value.split())
        elif key == "properties":
            value = {name: structural(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties"):
            value = structural(value, defs)
        elif key == "anyOf" and not node.get("x-kubernetes-int-or-string"):
            raise ValueError(f"anyOf is not structural outside int-or-string: {node}")
        elif key not in _KEY_ORDER:
            raise ValueError(f"no structural translation for {key!r} in {node}")
        out[key] = value
    if "type" not in out and not (out.get("x-kubernetes-preserve-unknown-fields") or out.get("x-kubernetes-int-or-string")):
        raise ValueError(f"schema node without a type: {node}")
    return {key: out[key] for key in sorted(out, key=_KEY_ORDER.index)}


def attribute_docstrings(model: type[models.ApiModel]) -> dict[str, str]:
    """Field name → the string literal right under the field's annotation, in `model` or the
    ApiModel it inherits the field from (pydantic's `use_attribute_docstrings` rule)."""
    found: dict[str, str] = {}
    for cls in reversed(model.__mro__):  # a subclass's docstring wins
        if not (isinstance(cls, type) and issubclass(cls, models.ApiModel)):
            continue
        (definition,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
        assert isinstance(definition, ast.ClassDef)
        for field, doc in zip(definition.body, definition.body[1:], strict=False):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
                found[field.target.id] = inspect.cleandoc(doc.value.value)
    return found


class _DescribedByDocstrings(GenerateJsonSchema):
    """pydantic's JSON schema, each model's properties described by their attribute docstrings."""

    def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
        json_schema = super().model_schema(schema)
        model, properties = schema["cls"], json_schema.get("properties", {})
        if issubclass(model, models.ApiModel):
            for name, doc in attribute_docstrings(model).items():
                field = model.model_fields.get(name)
                if field is not None and field.description is None and (field.alias or name) in properties:
                    properties[field.alias or name] = {**properties[field.alias or name], "description": doc}
        return json_schema


def model_schema(model: type[models.ApiModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, schema_generator=_DescribedByDocstrings)
    return structural(schema, schema.pop("$defs", {}))


def _column(name: str, json_path: str, type: str, description: str, priority: int = 0) -> dict[str, Any]:
    column: dict[str, Any] = {"name": name, "type": type, "jsonPath": json_path, "description": description}
    if priority:
        column["priority"] = priority
    return column


def build_crd() -> dict[str, Any]:
    root = {
        "description": " ".join((models.Task.__doc__ or "").split()),
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": model_schema(models.TaskSpec),
            "status": model_schema(models.TaskStatus),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": models.GROUP,
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": [models.SHORT_NAME],
                "categories": [models.CATEGORY],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        _column("Phase", ".status.phase", "string", "Task phase"),
                        _column("Progress", ".status.progress", "string", "Completed steps / total steps"),
                        _column("Attempt", ".status.attempt", "integer", "Current attempt"),
                        _column("Retries", ".status.retries", "integer", "Attempts that failed retryably", 1),
                        _column("Disruptions", ".status.disruptions", "integer", "Attempts lost to disruptions", 1),
                        _column("Age", ".metadata.creationTimestamp", "date", "Time since creation"),
                    ],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    # Shared sub-schemas (step and verify actions) are written out in full, not as YAML anchors.
    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd() -> str:
    header = "# Generated from retex.api.models by `make crds` (python -m retex.api.crd). Do not edit.\n"
    return header + yaml.dump(build_crd(), Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


if __name__ == "__main__":
    sys.stdout.write(render_crd())
