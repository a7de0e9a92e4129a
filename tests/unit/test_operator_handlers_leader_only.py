"""Every kopf handler of a Task waits for this replica to lead before it writes (`leader_only`):
between losing the lease and kopf stopping, a handler on the old leader must not act."""

import asyncio
import logging
from types import SimpleNamespace

import kopf
import pytest

import retex.operator.handlers as handlers  # registers the handlers with kopf
from retex.kube.operator_calls import NotLeading
from retex.ledger import NotLeader

LOGGER = logging.getLogger("kopf.objects")  # what kopf hands every handler: the Task's logger


def test_every_task_handler_is_leader_only():
    registry = kopf.get_default_registry()
    task_handlers = [*registry._changing.get_all_handlers(), *registry._watching.get_all_handlers(),
                     *registry._spawning.get_all_handlers()]
    assert task_handlers, "no Task handlers registered"
    not_gated = sorted(str(h.id) for h in task_handlers if h.fn.__code__.co_name != "when_leading")
    assert not not_gated, f"handlers that act without leading: {not_gated}"


class Runtime:
    """What `leader_only` asks of the runtime: whether it may write, and the election's timing."""

    def __init__(self, writing):
        self.writing = writing  # the answers of may_write(), in turn
        self.leadership = type("L", (), {"timing": type("T", (), {"retry_period": 0.01})()})()
        self.terms_lost = []

    def _term_lost(self, refused):
        self.terms_lost.append(refused.term)

    async def until_writing(self):
        while not (self.writing.pop(0) if self.writing else False):  # then not leading for good
            await asyncio.sleep(0)


def test_a_handler_that_meets_a_lost_leadership_waits_rather_than_have_kopf_write_a_retry():
    """A kopf.TemporaryError would have kopf patch its progress annotation onto the Task: a write
    by a replica that no longer leads. The handler waits instead, and runs again once this replica
    writes again (kopf, stopping meanwhile, cancels it: nothing is written)."""
    calls = []

    def handler(**_):
        calls.append(len(calls))
        if len(calls) == 1:
            raise NotLeading("patch Task ns/t")
        return "done"

    wrapped = handlers.leader_only(handler)
    runtime = Runtime([True, False, False, True])
    assert asyncio.run(wrapped(memo=SimpleNamespace(runtime=runtime), logger=LOGGER)) == "done"
    assert calls == [0, 1]


def test_a_handler_waiting_for_leadership_is_cancelled_when_kopf_stops_and_raises_nothing_kopf_would_write():
    def handler(**_):
        raise NotLeader("the term is 2", term=1)

    async def run():
        waiting = asyncio.create_task(handlers.leader_only(handler)(memo=SimpleNamespace(
            runtime=Runtime([True])), logger=LOGGER))
        await asyncio.sleep(0.05)
        waiting.cancel()  # what kopf does to its workers when it stops
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(run())


def test_a_handler_refused_by_the_ledgers_term_reports_the_lost_term_as_a_writer_loop_does():
    """May_write() may still say yes (a host suspend, two installs on one database): the refusal
    must restart the leadership, or the handler would run again and again against a lost term."""
    calls = []

    def handler(**_):
        calls.append(1)
        if len(calls) == 1:
            raise NotLeader("the term is 3", term=2)
        return "done"

    runtime = Runtime([True, True])
    assert asyncio.run(handlers.leader_only(handler)(memo=SimpleNamespace(runtime=runtime), logger=LOGGER)) == "done"
    assert runtime.terms_lost == [2]
