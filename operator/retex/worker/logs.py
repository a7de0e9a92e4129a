"""Structured logs: one JSON object per line on stderr, every line naming the task and step.

The task fields are attached by a handler filter, so lines from libraries (the ledger's retries,
the Kubernetes client) carry them too.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any


class TaskFields(logging.Filter):
    """Adds uid, namespace, name, epoch and the current step to every record."""

    def __init__(self, **fields: Any):
        super().__init__()
        self.fields = fields
        self.step: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        record.task_fields = {**self.fields, "step": self.step}
        return True


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


def configure(**task_fields: Any) -> TaskFields:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    tagger = TaskFields(**task_fields)
    handler.addFilter(tagger)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    return tagger


def event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log `msg` with extra structured fields."""
    logger.log(level, msg, extra={"fields": fields})
