"""The operator's log lines are JSON objects, kopf's own per-object lines included: they name the
Task (uid, namespace, name) as the operator's lines do, so one grep for a uid finds them all."""

import asyncio
import json
import logging
from types import SimpleNamespace

import kopf
import pytest
from kopf._core.actions.loggers import ObjectLogger

import retex.operator.handlers as handlers
from retex.logs import JsonLines, log_line
from retex.machine import IllegalTransition

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


class RefusingRuntime:
    """A leading replica whose ledger refuses the requeue and resolve the handlers are asked for."""

    def __init__(self):
        self.warned = []
        self.ledger = SimpleNamespace(requeue=self.refuse, resolve_step=self.refuse)
        self.mirror = SimpleNamespace(warn=lambda body, reason, message: self.warned.append(reason))

    def refuse(self, *_, **__):
        raise IllegalTransition("task", "Running", "requeue")

    async def until_writing(self):
        return None


@pytest.mark.parametrize("handler, new", [
    (handlers.requeue, "2026-12-05T04:00:00Z"),
    (handlers.resolve, json.dumps({"step": "charge", "markDone": True})),
])
def test_a_handlers_own_line_goes_through_kopfs_logger_for_the_task_and_names_it(handler, new):
    runtime = RefusingRuntime()
    logger = ObjectLogger(body=kopf.Body(BODY), settings=kopf.OperatorSettings())
    line = formatted(lambda: asyncio.run(handler(uid="u-1", new=new, body=kopf.Body(BODY),
                                                 memo=SimpleNamespace(runtime=runtime), logger=logger)))
    assert line["logger"] == "kopf.objects" and line["msg"].endswith("refused")
    assert (line["uid"], line["namespace"], line["name"]) == ("u-1", "shop", "order-1042")
    assert runtime.warned
