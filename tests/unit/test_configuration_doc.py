"""docs/configuration.md lists every RETEX_* setting the operator reads and every Helm value."""

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
# The modules that read the operator's environment: its settings and its entry point.
READERS = (ROOT / "operator" / "retex" / "operator" / "settings.py", ROOT / "operator" / "retex" / "operator" / "main.py")
SETTING = re.compile(r"RETEX_[A-Z0-9_]*[A-Z0-9]")


def settings_read(path: Path) -> set[str]:
    """Every string literal in `path` that is a whole RETEX_* name."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SETTING.fullmatch(node.value)}


def value_paths(values: dict, prefix: str = "") -> set[str]:
    """Every value's dotted path, maps of settings (resources, labels) as one."""
    paths = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("resources", "labels", "tenantTaskPolicy"):
            paths |= value_paths(value, f"{path}.")
        else:
            paths.add(path)
    return paths


def test_every_setting_the_operator_reads_is_listed():
    names = set().union(*(settings_read(path) for path in READERS))
    assert {"RETEX_DATABASE_URL", "RETEX_WORKER_IMAGE", "RETEX_NAMESPACES"} <= names
    listed = set(re.findall(r"`(RETEX_[A-Z0-9_]+)`", PAGE.read_text()))
    assert sorted(names - listed) == [], "settings the operator reads that docs/configuration.md does not list"


def test_every_helm_value_is_listed():
    values = yaml.safe_load((ROOT / "charts" / "retex" / "values.yaml").read_text())
    listed = set(re.findall(r"`([a-zA-Z][\w.]*)`", PAGE.read_text()))
    assert sorted(value_paths(values) - listed) == [], "chart values that docs/configuration.md does not list"
