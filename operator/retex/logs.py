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
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log `msg` with extra structured fields."""
    logger.log(level, msg, extra={"fields": fields})
