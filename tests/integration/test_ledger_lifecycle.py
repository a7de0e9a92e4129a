"""The attempt lifecycle in the ledger: purged tasks stay purged, human actions survive a lost
COMMIT reply, slots and keys are refilled on every transition that frees them and held until the
old attempt is known dead, and attempts that never start or are cancelled without a worker end."""

import time
from datetime import datetime, timedelta

import psycopg
import pytest

from retex.ledger import Dispatch, TaskNotFound, operator_operations
from retex.machine import TaskPhase
from tests.integration.ledger_helpers import admission, admitted, run_all_steps


def phases(ledger, uids):
    return [ledger.get(uid).phase for uid in uids]


def lose_first_commit_reply(ledger, monkeypatch, op_name):
    """The first `op_name` transaction commits, then its caller sees the connection drop (as when
    the COMMIT reply is lost): the ledger's retry wrapper runs the operation again. Returns a list
    that holds the operation's name once the fault has fired."""
    real = ledger._retrying
    fired = []

    def retrying(fn, *, op):
        if op != op_name or fired:
            return real(fn, op=op)

        def first_then_normal():
            result = fn()  # commits
            if not fired:
                fired.append(op)
                raise psycopg.OperationalError("server closed the connection unexpectedly (test: reply lost)")
            return result

        return real(first_then_normal, op=op)

    monkeypatch.setattr(ledger, "_retrying", retrying)
    return fired


def succeed(ledger, uid):
    record = ledger.get(uid)
    run_all_steps(ledger, uid, record.epoch)
    ledger.complete_task(uid, record.epoch, actor="worker")


# -- history retention ----------------------------------------------------------------------

def test_a_purged_task_is_never_admitted_again(ledger):
    task = admission()
    ledger.admit(task)
    succeed(ledger, task.uid)
    time.sleep(0.01)
    assert ledger.purge_finished(older_than_seconds=0) == 1
    again = ledger.admit(task)  # what the operator's resume handler does on its next start
    assert again.created is False, f"admitted again: {ledger.get(task.uid).phase} at epoch {ledger.get(task.uid).epoch}"
    assert again.purged
    with pytest.raises(TaskNotFound):
        ledger.get(task.uid)


def test_purging_keeps_unfinished_tasks_and_their_uids_admit_as_before(ledger):
    task = admission()
    ledger.admit(task)
    assert ledger.purge_finished(older_than_seconds=0) == 0
    assert ledger.admit(task).created is False
    assert ledger.get(task.uid).phase == TaskPhase.RUNNING


def counted_so_far(ledger) -> dict[str, object]:
    """The figures that count since the ledger began (LedgerFigures): a purge must keep them."""
    figures = ledger.figures()
    return {"submitted": figures.submitted, "finished": figures.finished_by_phase,
            "dead_lettered": figures.dead_lettered_ever, "attempts": figures.attempts_by_cause,
            **{name: (h.count, pytest.approx(h.total), h.cumulative) for name, h in
               (("step", figures.step_seconds), ("task", figures.task_seconds), ("first", figures.first_step_seconds))}}


def test_a_purge_of_more_than_a_batch_goes_a_bounded_transaction_at_a_time_and_keeps_the_tallies(ledger, monkeypatch):
    """Each batch is a fenced transaction of its own, so a large first purge holds the leadership
    term only a batch at a time (a successor's take_term waits for one batch, not for all)."""
    finished = []
    for n in range(7):
        task = admission(steps=("only",), max_attempts=1)
        ledger.admit(task)
        if n % 3:
            succeed(ledger, task.uid)
        else:  # dead-lettered: its tallies go too
            ledger.begin_step(task.uid, 1, 0, actor="worker")
            ledger.fail_step(task.uid, 1, 0, "boom", retryable=True, actor="worker")
        finished.append(task.uid)
    running = admitted(ledger)
    time.sleep(0.01)
    before = counted_so_far(ledger)
    batches: list[tuple[str, int]] = []
    purge_batch = operator_operations.purge_finished

    def purge_counted(cur, **kwargs):
        purged = purge_batch(cur, **kwargs)
        batches.append((cur.execute("SELECT pg_current_xact_id()::text").fetchone()[0], purged))
        return purged

    monkeypatch.setattr(operator_operations, "purge_finished", purge_counted)
    assert ledger.purge_finished(older_than_seconds=0, batch=3) == 7
    assert [purged for _, purged in batches] == [3, 3, 1]
    assert len({transaction for transaction, _ in batches}) == 3, "batches shared a transaction"
    for uid in finished:
        with pytest.raises(TaskNotFound):
            ledger.get(uid)
    assert ledger.get(running).phase == TaskPhase.RUNNING
    assert counted_so_far(ledger) == before
    assert ledger.purge_finished(older_than_seconds=0, batch=3) == 0


# -- lost COMMIT replies of human actions --------------------------------------------------

def test_a_requeue_whose_commit_reply_was_lost_succeeds_once(ledger, monkeypatch):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.fail_step(uid, 1, 0, "card declined", retryable=False, actor="worker")
    fired = lose_first_commit_reply(ledger, monkeypatch, "requeue")
    record = ledger.requeue(uid, actor="cli:alice")
    assert fired == ["requeue"]
    assert (record.phase, record.epoch) == (TaskPhase.RUNNING, 2)
    assert [h.event for h in ledger.history(uid)].count("requeue") == 1


def test_a_resolve_whose_commit_reply_was_lost_succeeds_once(ledger, monkeypatch):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.flag_step(uid, 1, 0, "charge outcome unknown", actor="worker")
    fired = lose_first_commit_reply(ledger, monkeypatch, "resolve_step")
    record = ledger.resolve_step(uid, "charge", mark_done=True, result={"charged": True}, actor="cli:alice")
    assert fired == ["resolve_step"]
    assert (record.phase, record.epoch, record.steps[0].state) == (TaskPhase.RUNNING, 2, "done")
    assert [h.event for h in ledger.history(uid)].count("step-resolve-done") == 1


def test_a_once_operation_rolled_back_is_run_again_even_if_another_transaction_wrote_history_since(
        ledger, dsn, monkeypatch):
    # `_tx_once`'s own contract, below today's callers (which lock the task row first, so the
    # foreign key keeps others from writing its history meanwhile): the first try writes a history
    # row, another transaction commits a later one for the same task, then the first try's
    # connection drops before COMMIT. The retry must not take the other row for its own.
    uid = admitted(ledger)
    tries = []

    def op(cur):
        tries.append(1)
        ledger._history(cur, uid, "cli:alice", "note")
        if len(tries) == 1:
            with psycopg.connect(dsn) as other:
                other.execute("INSERT INTO retex.history (task_uid, actor, event) VALUES (%s, 'operator', 'other')",
                              (uid,))
        return "done"

    real_tx, dropped = ledger._tx, []

    def tx(fn, *, op, **options):
        def dropped_before_commit_once(cur):
            result = fn(cur)
            if not dropped:
                dropped.append(op)
                raise psycopg.OperationalError("server closed the connection unexpectedly (test: before COMMIT)")
            return result

        return real_tx(dropped_before_commit_once, op=op, **options)

    monkeypatch.setattr(ledger, "_tx", tx)
    assert ledger._tx_once(op, uid=uid, op="note") == "done"
    assert [h.event for h in ledger.history(uid)].count("note") == 1


# -- refilling slots and keys ---------------------------------------------------------------

@pytest.mark.parametrize("end", ["cancel", "abandon"])
def test_ending_a_retrying_key_holder_starts_the_next_task_of_its_key(ledger, end):
    holder = admitted(ledger, concurrency_key="k")
    follower = admitted(ledger, concurrency_key="k")
    ledger.begin_step(holder, 1, 0, actor="worker")
    ledger.fail_step(holder, 1, 0, "503", retryable=True, actor="worker")
    assert phases(ledger, [holder, follower]) == ["Retrying", "Queued"]
    if end == "cancel":
        ledger.request_cancel(holder)
    else:
        ledger.abandon(holder, reason="TaskDeleted")
    assert phases(ledger, [holder, follower]) == ["Cancelled", "Running"]


def test_cancelling_a_key_holder_that_needs_attention_starts_the_next_task_of_its_key(ledger):
    holder = admitted(ledger, concurrency_key="k")
    follower = admitted(ledger, concurrency_key="k")
    ledger.begin_step(holder, 1, 0, actor="worker")
    ledger.flag_step(holder, 1, 0, "ambiguous", actor="worker")
    ledger.request_cancel(holder)
    assert phases(ledger, [holder, follower]) == ["Cancelled", "Running"]


def test_a_queue_head_skipped_while_locked_is_started_by_the_periodic_fill(ledger, dsn):
    holder = admitted(ledger, concurrency_key="k")
    follower = admitted(ledger, concurrency_key="k")
    with psycopg.connect(dsn) as other:
        # Someone holds the queue head's row (a status read FOR UPDATE, a slow admission...):
        # the placement that runs when the holder completes skips it (SKIP LOCKED).
        other.execute("SELECT 1 FROM retex.tasks WHERE uid = %s FOR UPDATE", (follower,))
        succeed(ledger, holder)
        assert phases(ledger, [follower]) == ["Queued"]
    ledger.fill_slots()
    assert phases(ledger, [follower]) == ["Running"]


# -- an attempt the operator ended keeps its slot and key until it is known dead ------------

def test_a_timed_out_key_holder_keeps_its_key_until_its_attempt_is_settled(ledger):
    holder = admitted(ledger, concurrency_key="k", timeout_seconds=1)
    follower = admitted(ledger, concurrency_key="k")
    ledger.begin_step(holder, 1, 0, actor="worker")  # the step runs on and on
    time.sleep(1.1)
    ledger.promote_due()
    assert phases(ledger, [holder, follower]) == ["Failed", "Queued"]
    assert [(w.uid, w.epoch, w.current) for w in ledger.watched()] == [(holder, 1, False)]
    ledger.settle_attempt(holder, 1)  # the reaper: its lease expired or was released
    assert phases(ledger, [follower]) == ["Running"]
    assert [w.uid for w in ledger.watched()] == [follower]


def test_a_deleted_running_task_keeps_its_run_slot_until_its_attempt_is_settled(ledger):
    ledger.set_run_limits(max_running=1, max_running_per_namespace=None)
    deleted = admitted(ledger)
    waiting = admitted(ledger)
    ledger.abandon(deleted, reason="TaskDeleted")
    assert phases(ledger, [deleted, waiting]) == ["Cancelled", "Queued"]
    ledger.settle_attempt(deleted, 1)
    assert phases(ledger, [waiting]) == ["Running"]


# -- attempts that never start, and cancels without a worker ---------------------------------

def test_an_attempt_that_never_started_is_a_failed_attempt_with_its_reason(ledger):
    uid = admitted(ledger, max_attempts=2)
    record = ledger.fail_unstarted(uid, 1, "worker pod did not start: ImagePullBackOff: no such image")
    assert (record.phase, record.reason, record.failures) == (TaskPhase.RETRYING, "WorkerNotStarted", 1)
    assert "ImagePullBackOff" in record.last_error
    assert ledger.fail_unstarted(uid, 1, "repeated") == ledger.get(uid)  # stale epoch: no-op
    ledger.promote_due()
    wait_until_running(ledger, uid)
    record = ledger.fail_unstarted(uid, 2, "worker pod did not start: Unschedulable")
    assert (record.phase, record.reason, record.dead_lettered) == (TaskPhase.FAILED, "RetriesExhausted", True)
    assert [a.outcome for a in ledger.attempts(uid)] == ["failed", "failed"]


def test_an_attempt_whose_worker_claimed_it_is_not_failed_as_unstarted(ledger):
    # The race: the reaper read "no lease" and decided; before its fail_unstarted commits, the
    # slow worker takes the lease, claims the attempt and begins a step.
    uid = admitted(ledger, concurrency_key="k")
    follower = admitted(ledger, concurrency_key="k")
    ledger.claim_attempt(uid, 1, pod="worker-1", node="node-a")
    ledger.begin_step(uid, 1, 0, actor="worker")
    record = ledger.fail_unstarted(uid, 1, "worker of attempt 1 did not start within 120s")
    assert (record.phase, record.epoch, record.failures) == (TaskPhase.RUNNING, 1, 0)
    assert [a.outcome for a in ledger.attempts(uid)] == [None]
    assert phases(ledger, [follower]) == ["Queued"]  # its key is still held


def wait_until_running(ledger, uid):
    deadline = time.monotonic() + 5
    while ledger.get(uid).phase != TaskPhase.RUNNING:
        assert time.monotonic() < deadline, ledger.get(uid).phase
        time.sleep(0.02)
        ledger.promote_due()


def test_a_delete_of_a_running_task_without_a_worker_ends_it_at_once_as_task_deleted(ledger):
    uid = admitted(ledger, concurrency_key="k")
    follower = admitted(ledger, concurrency_key="k")
    assert ledger.cancel_unheld(uid, 1).phase == TaskPhase.RUNNING  # no cancel asked: no-op
    ledger.request_cancel(uid, reason="TaskDeleted")
    record = ledger.cancel_unheld(uid, 1)
    assert (record.phase, record.reason) == (TaskPhase.CANCELLED, "TaskDeleted")
    assert phases(ledger, [follower]) == ["Running"]


def test_a_cancel_without_a_lease_holder_keeps_the_key_while_a_worker_that_claimed_the_attempt_may_run(ledger):
    # The worker claimed its attempt and began a step before the delete; then the reaper saw no
    # lease held by it (its Lease deleted with the Task's dependents first: a foreground delete, a
    # namespace deletion). The task ends now, but the step may still be running: its key and slot
    # stay taken until the reaper knows that worker dead.
    uid = admitted(ledger, concurrency_key="k")
    follower = admitted(ledger, concurrency_key="k")
    ledger.claim_attempt(uid, 1, pod="worker-1", node="node-a")
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.request_cancel(uid, reason="TaskDeleted")
    record = ledger.cancel_unheld(uid, 1)
    assert (record.phase, record.reason) == (TaskPhase.CANCELLED, "TaskDeleted")
    assert phases(ledger, [follower]) == ["Queued"]
    assert [(w.uid, w.epoch, w.current) for w in ledger.watched()] == [(uid, 1, False)]
    ledger.settle_attempt(uid, 1)  # the reaper, once the worker is known dead
    assert phases(ledger, [follower]) == ["Running"]


def test_a_running_task_deleted_by_its_user_ends_as_task_deleted_when_its_worker_stops(ledger):
    uid = admitted(ledger)
    ledger.claim_attempt(uid, 1, pod="worker-1", node=None)
    ledger.request_cancel(uid, reason="TaskDeleted")  # the delete handler
    record = ledger.finish_cancelled(uid, 1, actor="worker")  # the worker, at its step boundary
    assert (record.phase, record.reason) == (TaskPhase.CANCELLED, "TaskDeleted")


def test_a_cancel_reason_must_be_known(ledger):
    uid = admitted(ledger)
    with pytest.raises(ValueError, match="cancel reason"):
        ledger.request_cancel(uid, reason="Bored")


def test_time_left_is_measured_on_the_database_clock(ledger):
    uid = admitted(ledger, timeout_seconds=60)
    left = ledger.seconds_until(ledger.get(uid).deadline_at)
    assert 55 < left <= 60
    assert ledger.seconds_until(ledger.get(uid).deadline_at - timedelta(seconds=120)) < -55


def test_a_jobs_deadline_is_the_time_left_on_the_database_clock_whatever_the_operators_clock(ledger, monkeypatch):
    from retex.operator import dispatch

    uid = admitted(ledger, timeout_seconds=60)
    record = ledger.get(uid)
    job = Dispatch(id=1, task_uid=uid, epoch=1, namespace=record.namespace, name=record.name, spec=record.spec,
                   deadline_at=record.deadline_at)

    class TenMinutesFast(datetime):  # the operator's host clock is off; the database's is not
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + timedelta(minutes=10)

    monkeypatch.setattr(dispatch, "datetime", TenMinutesFast, raising=False)
    assert 65 < dispatch._time_left(ledger, job) <= 70  # 60 s left + the 10 s margin
