"""Structured log lines shared by the operator and the worker: one JSON object per line, so one
task can be followed across processes with one grep for its uid."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, "task_fields", {}),
            **_kopf_object(record),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def _kopf_object(record: logging.LogRecord) -> dict[str, Any]:
    """The Task of a line kopf logs through its per-object logger ("Handler 'admit' failed ..."):
    under the names the operator's own lines use, so one grep for a uid finds kopf's lines too."""
    ref = getattr(record, "k8s_ref", None) or {}
    return {key: ref[key] for key in ("uid", "namespace", "name") if ref.get(key)}


def log_line(logger: logging.Logger | logging.LoggerAdapter[Any], level: int, msg: str, *, exc_info: bool = False,
             **fields: Any) -> None:
    """Log `msg` with extra structured fields (and the exception being handled, with exc_info)."""
    logger.log(level, msg, exc_info=exc_info, extra={"fields": fields})
