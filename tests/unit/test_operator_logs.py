"""The operator's log lines are JSON objects, kopf's own per-object lines included: they name the
Task (uid, namespace, name) as the operator's lines do, so one grep for a uid finds them all."""

import json
import logging

import kopf
from kopf._core.actions.loggers import ObjectLogger

from retex.logs import JsonLines, log_line

BODY = {"apiVersion": "retex.dev/v1alpha1", "kind": "Task",
        "metadata": {"name": "order-1042", "namespace": "shop", "uid": "u-1"}}


def formatted(emit) -> dict:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("kopf").addHandler(handler)
    logging.getLogger("retex").addHandler(handler)
    try:
        emit()
    finally:
        logging.getLogger("kopf").removeHandler(handler)
        logging.getLogger("retex").removeHandler(handler)
    [record] = records
    return json.loads(JsonLines().format(record))


def test_a_line_kopf_logs_for_a_task_names_its_uid_namespace_and_name():
    logger = ObjectLogger(body=kopf.Body(BODY), settings=kopf.OperatorSettings())
    line = formatted(lambda: logger.error("Handler 'admit' failed with an exception. Will retry."))
    assert (line["uid"], line["namespace"], line["name"]) == ("u-1", "shop", "order-1042")
    assert line["logger"] == "kopf.objects" and line["level"] == "error"


def test_an_operator_event_keeps_its_fields_and_carries_the_exception_when_asked():
    log = logging.getLogger("retex.operator.loop")

    def fail_and_log():
        try:
            raise RuntimeError("API server unreachable")
        except RuntimeError:
            log_line(log, logging.ERROR, "round failed; retrying", loop="relay", exc_info=True)

    line = formatted(fail_and_log)
    assert line["msg"] == "round failed; retrying" and line["loop"] == "relay"
    assert "RuntimeError: API server unreachable" in line["exc"]
