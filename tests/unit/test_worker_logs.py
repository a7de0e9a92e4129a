"""Every log line is one JSON object naming the task, the attempt and the current step, including
lines from libraries the worker uses."""

import io
import json
import logging

from retex.logs import log_line
from retex.worker import logs


def capture(stream: io.StringIO) -> logs.TaskFields:
    tagger = logs.configure(task_uid="u-1", namespace="shop", name="order-1", epoch=4, pod="pod-a")
    logging.getLogger().handlers[0].setStream(stream)
    return tagger


def test_worker_events_and_library_lines_carry_task_epoch_and_step():
    stream = io.StringIO()
    tagger = capture(stream)
    try:
        log_line(logging.getLogger("retex.worker.attempt"), logging.INFO, "step running", idempotency_key="k-1")
        tagger.step = "charge"
        logging.getLogger("psycopg.pool").warning("connection lost")
        tagger.step = None
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        logging.getLogger().handlers.clear()
    task = {"task_uid": "u-1", "namespace": "shop", "name": "order-1", "epoch": 4, "pod": "pod-a"}
    assert lines[0] | task == lines[0] and lines[0]["step"] is None
    assert (lines[0]["msg"], lines[0]["idempotency_key"], lines[0]["level"]) == ("step running", "k-1", "info")
    assert lines[1] | task == lines[1]
    assert (lines[1]["step"], lines[1]["logger"], lines[1]["level"]) == ("charge", "psycopg.pool", "warning")
