"""What running a step (or its verify) can end in, and how results are kept within the ledger's limit."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from retex.ledger import RESULT_LIMIT_BYTES

# Room left under the ledger's limit for the fields around bounded text.
RESULT_BUDGET_BYTES = RESULT_LIMIT_BYTES - 1024


@dataclass(frozen=True)
class Succeeded:
    result: Any


@dataclass(frozen=True)
class Failed:
    """The step reported a failure (exit code, HTTP status, raised error): its effect is not done."""

    error: str
    retryable: bool


@dataclass(frozen=True)
class Unknown:
    """No answer: the effect may or may not have happened (timeout, killed, connection lost after
    sending). Resolved like an interrupted step: verify, or idempotent retry, or a human."""

    error: str


@dataclass(frozen=True)
class Abandoned:
    """Stopped by the pod's drain deadline before it answered. Nothing may be recorded about it:
    the step stays `started` and the next attempt resolves it."""

    why: str


StepOutcome = Succeeded | Failed | Unknown | Abandoned


@dataclass(frozen=True)
class Found:
    """The verify found the effect; `result` is committed as the step's result."""

    result: Any


@dataclass(frozen=True)
class NotFound:
    """The verify found no trace of the effect: the step must run."""


@dataclass(frozen=True)
class VerifyFailed:
    """The verify could not tell (errored, timed out, answered outside its convention)."""

    error: str


VerifyOutcome = Found | NotFound | VerifyFailed | Abandoned


def json_size(value: Any) -> int:
    return len(json.dumps(value).encode())


def tail_text(data: bytes, limit: int) -> tuple[str, bool]:
    """The last bytes of `data` as text whose JSON encoding fits in `limit`; and whether it was cut."""
    text = data.decode("utf-8", errors="replace")
    if json_size(text) <= limit:
        return text, False
    # Escapes (\uXXXX) can make the JSON several times longer than the text: shrink until it fits.
    keep = min(len(text), limit)
    while keep and json_size(text[-keep:]) > limit:
        keep = int(keep * 0.9)
    return text[len(text) - keep:], True


def head_text(data: bytes, limit: int) -> tuple[str, bool]:
    """Like `tail_text`, keeping the beginning (for response bodies)."""
    text = data.decode("utf-8", errors="replace")
    if json_size(text) <= limit:
        return text, False
    keep = min(len(text), limit)
    while keep and json_size(text[:keep]) > limit:
        keep = int(keep * 0.9)
    return text[:keep], True


def bounded_result(result: Any) -> Any:
    """`result` if it is JSON and fits the ledger; otherwise a marked, truncated preview of it.

    The effect happened, so the step is still committed done: only its recorded result is cut.
    """
    try:
        encoded, is_json = json.dumps(result).encode(), True
    except (TypeError, ValueError):
        encoded, is_json = json.dumps(result, default=repr).encode(), False
    if is_json and len(encoded) <= RESULT_BUDGET_BYTES:
        return result
    preview, cut = head_text(encoded, RESULT_BUDGET_BYTES // 2)
    return {"truncated": cut, "bytes": len(encoded), "preview": preview}


# What Postgres refuses in text and jsonb: NUL, and UTF-16 surrogates that pair with nothing.
_UNSTORABLE_CHARS = re.compile("[\x00\ud800-\udfff]")
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
SANITIZED_NOTE = " [retex: NUL or invalid characters replaced with U+FFFD]"


def storable(value: Any) -> tuple[Any, bool]:
    """`value` with what the ledger cannot store replaced, and whether anything was: NUL and lone
    surrogates in strings (keys too) become U+FFFD, NaN and ±Infinity become the strings "NaN",
    "Infinity", "-Infinity" (jsonb has no such numbers)."""
    if isinstance(value, str):
        clean = _storable_text(value)
        return clean, clean != value
    if isinstance(value, float) and not math.isfinite(value):
        return ("NaN" if math.isnan(value) else _NON_FINITE[value]), True
    if isinstance(value, dict):
        pairs = [(storable(k), storable(v)) for k, v in value.items()]
        return {k: v for (k, _), (v, _) in pairs}, any(kc or vc for (_, kc), (_, vc) in pairs)
    if isinstance(value, list | tuple):
        items = [storable(v) for v in value]
        return [v for v, _ in items], any(c for _, c in items)
    return value, False


def stored_result(result: Any) -> Any:
    """The result as the ledger will keep it: storable, bounded, and marked `"sanitized": true`
    (a non-object result is wrapped as {"sanitized": true, "value": ...}) when anything was replaced."""
    clean, changed = storable(result)
    bounded = bounded_result(clean)
    if not changed:
        return bounded
    return {**bounded, "sanitized": True} if isinstance(bounded, dict) else {"sanitized": True, "value": bounded}


def stored_text(text: str) -> str:
    """Error text the ledger can store; says so when characters had to be replaced."""
    clean = _storable_text(text)
    return clean + SANITIZED_NOTE if clean != text else clean


def _storable_text(text: str) -> str:
    return _UNSTORABLE_CHARS.sub("\ufffd", text)
