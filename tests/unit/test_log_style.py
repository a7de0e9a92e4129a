"""One logging style: every line retex logs goes through `retex.logs.log_line`, a fixed
message with its values as fields, so a line is found by its message and read by its fields; no
%-formatted text that folds the values into the message."""

from __future__ import annotations

import ast
from pathlib import Path

import retex

PACKAGE = Path(retex.__file__).parent
LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def direct_log_calls(path: Path) -> list[str]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS
                and isinstance(node.func.value, ast.Name) and node.func.value.id in {"log", "logger", "logging"}):
            calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return calls


def test_every_log_call_in_retex_is_a_structured_log_line():
    found = [call for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "logs.py"
             for call in direct_log_calls(path)]
    assert found == []
