"""Structured logs: one JSON object per line on stderr, every line naming the task and step.

The task fields are attached by a handler filter, so lines from libraries (the ledger's retries,
the Kubernetes client) carry them too.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from retex.logs import JsonLines


class TaskFields(logging.Filter):
    """Adds uid, namespace, name, epoch and the current step to every record."""

    def __init__(self, **fields: Any):
        super().__init__()
        self.fields = fields
        self.step: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        record.task_fields = {**self.fields, "step": self.step}
        return True


def configure(**task_fields: Any) -> TaskFields:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    tagger = TaskFields(**task_fields)
    handler.addFilter(tagger)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    return tagger


def process_age_seconds() -> float | None:
    """How long ago the kernel started this process (its start time in /proc/self/stat, in clock
    ticks since boot): what a worker's start cost before its first log line, interpreter and
    imports included. None where that cannot be read: a figure for the log, never a reason not
    to start."""
    try:
        with open("/proc/self/stat") as stat:
            started_ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22; the name may hold spaces
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
