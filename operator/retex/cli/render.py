"""Plain-text tables and JSON for the CLI. Pure: records in, text out."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from retex.ledger import AttemptRecord, HistoryEntry, TaskRecord


def when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def brief(value: Any, width: int = 48) -> str:
    """A one-line summary of a result or error, cut to `width` characters."""
    if value is None:
        return "-"
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if c is None or c == "" else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def ref(task: TaskRecord) -> str:
    return f"{task.namespace}/{task.name}"


def summary(task: TaskRecord) -> str:
    """One line: what state the task is in now."""
    phase = f"{task.phase}" + (f" ({task.reason})" if task.reason else "")
    flags = ", dead-lettered" if task.dead_lettered else ""
    return (f"{ref(task)}: {phase}{flags}; epoch {task.epoch}, failures {budget(task.failures, task.max_attempts)}, "
            f"disruptions {budget(task.disruptions, task.max_disruptions)}")


def budget(used: int, cap: int) -> str:
    """`used/cap`; past the cap (the attempt that broke it is counted) `used (cap N exceeded)`."""
    return f"{used}/{cap}" if used <= cap else f"{used} (cap {cap} exceeded)"


def history_text(task: TaskRecord, attempts: list[AttemptRecord], history: list[HistoryEntry]) -> str:
    names = {s.idx: s.name for s in task.steps}
    out = [f"Task {ref(task)}  uid {task.uid}", f"Phase: {summary(task).split(': ', 1)[1]}"]
    if task.last_error:
        out.append(f"Last error: {brief(task.last_error, 200)}")
    out += ["", "STEPS", table(
        ["#", "NAME", "STATE", "ATTEMPT", "RESULT", "ERROR"],
        [[s.idx, s.name, s.state, s.attempt, brief(s.result), brief(s.error)] for s in task.steps])]
    out += ["", "ATTEMPTS", table(
        ["EPOCH", "CAUSE", "JOB", "POD", "NODE", "OUTCOME", "STARTED", "ENDED"],
        [[a.epoch, a.cause, a.job_name, a.pod, a.node, a.outcome or "(running)", when(a.started_at),
          when(a.ended_at)] for a in attempts])]
    out += ["", "HISTORY", table(
        ["TIME", "ACTOR", "EVENT", "EPOCH", "STEP", "FROM → TO", "DETAIL"],
        [[when(h.at), h.actor, h.event, h.epoch, names.get(h.step_idx) if h.step_idx is not None else None,
          _arrow(h.from_state, h.to_state), _detail(h.detail)] for h in history])]
    return "\n".join(out)


def dead_letters_text(tasks: list[TaskRecord]) -> str:
    if not tasks:
        return "No dead-lettered tasks."
    return table(
        ["NAMESPACE", "NAME", "REASON", "FAILURES", "DISRUPTIONS", "EPOCH", "FAILED AT", "LAST ERROR"],
        [[t.namespace, t.name, t.reason, budget(t.failures, t.max_attempts), budget(t.disruptions, t.max_disruptions),
          t.epoch, when(t.finished_at), brief(t.last_error, 60)] for t in tasks])


def task_json(task: TaskRecord) -> dict[str, Any]:
    data = dataclasses.asdict(task)
    data["steps"] = [dataclasses.asdict(s) for s in task.steps]
    return data


def history_json(task: TaskRecord, attempts: list[AttemptRecord], history: list[HistoryEntry]) -> dict[str, Any]:
    names: dict[int | None, str] = {s.idx: s.name for s in task.steps}
    data = task_json(task)
    steps = data.pop("steps")
    entries = [dataclasses.asdict(h) | {"step": names.get(h.step_idx)} for h in history]
    return {"task": data, "steps": steps, "attempts": [dataclasses.asdict(a) for a in attempts], "history": entries}


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=_json_default)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _arrow(from_state: str | None, to_state: str | None) -> str:
    if not from_state and not to_state:
        return ""
    return f"{from_state or ''} → {to_state or ''}".strip()


def _detail(detail: dict[str, Any] | None) -> str:
    if not detail:
        return ""
    return " ".join(f"{k}={brief(v, 40)}" for k, v in detail.items())


# -- from the API server (the CLI as a Kubernetes user): Task objects and Events as plain dicts --


def task_status_text(task: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """A Task as its status shows it, then its Events, oldest first."""
    meta, status = task["metadata"], task.get("status") or {}
    lines = [f"task {meta['namespace']}/{meta['name']}  uid {meta['uid']}  phase {status.get('phase', '-')}  "
             f"progress {status.get('progress', '-')}"]
    steps = status.get("steps") or []
    if steps:
        lines += ["", table(["STEP", "STATE", "RESULT"], [(s.get("name"), s.get("state"), brief(s.get("result")))
                                                         for s in steps])]
    conditions = status.get("conditions") or []
    if conditions:
        lines += ["", table(["CONDITION", "STATUS", "REASON", "MESSAGE"],
                            [(c["type"], c["status"], c.get("reason"), brief(c.get("message"), 80)) for c in conditions])]
    ordered = sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    lines += ["", table(["TIME", "TYPE", "REASON", "MESSAGE"],
                        [(e.get("lastTimestamp") or e.get("eventTime"), e.get("type"), e.get("reason"),
                          brief(e.get("message"), 100)) for e in ordered]) if ordered else "no events"]
    return "\n".join(lines)


def tasks_text(tasks: list[dict[str, Any]]) -> str:
    if not tasks:
        return "no dead letters"
    return table(["NAMESPACE", "NAME", "PHASE", "PROGRESS"],
                 [(t["metadata"]["namespace"], t["metadata"]["name"], (t.get("status") or {}).get("phase"),
                   (t.get("status") or {}).get("progress")) for t in tasks])
