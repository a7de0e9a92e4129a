"""Every ledger operation is a top-level function that takes a cursor (retex.ledger.operator_operations,
worker_operations, readers, …; `Ledger` runs each in a retried transaction of its own): a test can
run several inside one transaction of its own, look at what they wrote, and roll it all back. The
cursor must have psycopg's default tuple rows (retex.ledger.rows.Cursor), as the pool's do."""

import psycopg
import pytest

from retex.ledger import CancelRequested, FenceRejected, operator_operations, readers, worker_operations
from retex.machine import TaskPhase
from tests.integration.ledger_helpers import admitted


def test_operations_run_in_a_transaction_that_is_rolled_back_leave_the_ledger_as_it_was(ledger, dsn):
    uid = admitted(ledger)
    before, history_before = ledger.get(uid), ledger.history(uid)
    assert before.phase == TaskPhase.RUNNING and before.epoch == 1

    with psycopg.connect(dsn) as conn:  # tuple rows, as the Ledger's pool hands out
        with conn.transaction(force_rollback=True), conn.cursor() as cur:
            asked = operator_operations.request_cancel(cur, uid, reason="Cancelled", actor="test")
            assert asked.phase == TaskPhase.RUNNING and asked.cancel_requested
            with pytest.raises(CancelRequested):
                worker_operations.begin_step(cur, uid, 1, 0, actor="worker", request=None)
            with pytest.raises(FenceRejected):
                worker_operations.finish_cancelled(cur, uid, 2, actor="worker")
            assert worker_operations.finish_cancelled(cur, uid, 1, actor="worker").phase == TaskPhase.CANCELLED
            events = [entry.event for entry in readers.history(cur, uid)]
            assert events[len(history_before):] == ["cancel-requested", "cancel"]
            assert ledger.get(uid) == before  # not committed: no other transaction sees it

    assert ledger.get(uid) == before
    assert ledger.history(uid) == history_before
