"""Ledger operations against a real Postgres: each one transaction, each idempotent when repeated."""

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from retex.ledger import (
    CancelRequested,
    ResultTooLarge,
    StepInFlight,
    StepNotFound,
    StepOutOfOrder,
    TaskRef,
)
from retex.machine import IllegalTransition, StepState, TaskPhase
from tests.integration.ledger_helpers import admission, admitted, run_all_steps


def count(dsn, sql, *args):
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, args).fetchone()[0]


def test_admitting_the_same_uid_twice_keeps_one_task_one_attempt_and_one_dispatch(ledger, dsn):
    task = admission()
    first = ledger.admit(task)
    again = ledger.admit(task)
    assert (first.created, again.created) == (True, False)
    assert count(dsn, "SELECT count(*) FROM retex.tasks") == 1
    assert count(dsn, "SELECT count(*) FROM retex.attempts") == 1
    assert count(dsn, "SELECT count(*) FROM retex.outbox") == 1
    record = ledger.get(task.uid)
    assert (record.phase, record.epoch, [s.state for s in record.steps]) == (TaskPhase.RUNNING, 1, ["pending"] * 3)


def test_an_idempotency_key_reused_in_a_namespace_returns_the_first_task(ledger, dsn):
    first = ledger.admit(admission(idempotency_key="order-42"))
    duplicate = ledger.admit(admission(idempotency_key="order-42"))
    elsewhere = ledger.admit(admission(idempotency_key="order-42", namespace="other"))
    first_task = TaskRef(uid=first.uid, namespace="shop", name=ledger.get(first.uid).name)
    assert duplicate == type(duplicate)(uid=first.uid, created=False, duplicate_of=first_task)
    assert elsewhere.created
    assert count(dsn, "SELECT count(*) FROM retex.tasks") == 2


def test_steps_get_stable_idempotency_keys_naming_task_and_step(ledger):
    uid = admitted(ledger)
    keys = [s.idempotency_key for s in ledger.get(uid).steps]
    assert [k.split(":")[:2] for k in keys] == [[uid, "charge"], [uid, "ship"], [uid, "email"]]
    assert len(set(keys)) == 3


def test_a_full_run_commits_every_step_and_succeeds_once(ledger):
    uid = admitted(ledger)
    run_all_steps(ledger, uid, 1)
    done = ledger.complete_task(uid, 1, actor="worker")
    again = ledger.complete_task(uid, 1, actor="worker")
    assert done.phase == again.phase == TaskPhase.SUCCEEDED
    assert done.version == again.version  # the repeat changed nothing
    assert [s.result for s in done.steps] == [{"step": "charge"}, {"step": "ship"}, {"step": "email"}]
    assert [a.outcome for a in ledger.attempts(uid)] == ["succeeded"]


def test_repeating_begin_and_commit_changes_nothing(ledger):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    version = ledger.get(uid).version
    assert ledger.begin_step(uid, 1, 0, actor="worker").state == StepState.STARTED
    ledger.commit_step(uid, 1, 0, {"charged": 10}, actor="worker")
    after_commit = ledger.get(uid).version
    ledger.commit_step(uid, 1, 0, {"charged": 10}, actor="worker")
    assert ledger.get(uid).version == after_commit > version
    assert [h.event for h in ledger.history(uid)].count("step-commit") == 1


def test_begin_returns_the_step_as_it_was_so_the_worker_sees_an_ambiguous_start(ledger):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.replace_attempt(uid, 1, cause="lease-expired")
    prior = ledger.begin_step(uid, 2, 0, actor="worker")
    assert (prior.state, prior.attempt) == (StepState.STARTED, 1)


def test_a_begin_sent_again_with_its_request_id_gets_the_first_answer_and_writes_nothing(ledger):
    uid = admitted(ledger)
    first = ledger.begin_step(uid, 1, 0, actor="worker", request="r1")
    version = ledger.get(uid).version
    again = ledger.begin_step(uid, 1, 0, actor="worker", request="r1")
    assert again == first and first.state == StepState.PENDING
    assert ledger.get(uid).version == version
    # Another call (another process of the attempt, or one that kept no id) is told the truth.
    assert ledger.begin_step(uid, 1, 0, actor="worker", request="r2").state == StepState.STARTED
    assert ledger.begin_step(uid, 1, 0, actor="worker").state == StepState.STARTED


def test_a_begin_of_an_interrupted_step_sent_again_still_names_the_attempt_that_began_it(ledger):
    uid = admitted(ledger)
    begun = ledger.begin_step(uid, 1, 0, actor="worker")
    started_at = ledger.get(uid).steps[0].started_at
    ledger.replace_attempt(uid, 1, cause="lease-expired")
    first = ledger.begin_step(uid, 2, 0, actor="worker", request="r1")
    again = ledger.begin_step(uid, 2, 0, actor="worker", request="r1")
    assert (first.state, first.attempt, first.started_at) == (StepState.STARTED, 1, started_at) != \
        (begun.state, begun.attempt, begun.started_at)
    assert again == first


def test_a_step_cannot_begin_before_the_steps_ahead_of_it_are_done(ledger):
    uid = admitted(ledger)
    with pytest.raises(StepOutOfOrder):
        ledger.begin_step(uid, 1, 1, actor="worker")


def test_the_resume_point_is_the_contiguous_done_prefix(ledger):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.commit_step(uid, 1, 0, "ok", actor="worker")
    ledger.begin_step(uid, 1, 1, actor="worker")
    assert ledger.get(uid).completed_steps == 1


def test_results_above_the_limit_are_refused_before_touching_the_ledger(ledger):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    with pytest.raises(ResultTooLarge):
        ledger.commit_step(uid, 1, 0, "x" * 70_000, actor="worker")
    assert ledger.get(uid).steps[0].state == StepState.STARTED


def test_a_retryable_failure_backs_off_then_the_budget_runs_out_into_the_dead_letter(ledger):
    uid = admitted(ledger, max_attempts=2)
    ledger.begin_step(uid, 1, 0, actor="worker")
    retrying = ledger.fail_step(uid, 1, 0, "HTTP 503", retryable=True, actor="worker")
    assert (retrying.phase, retrying.failures, retrying.dead_lettered) == (TaskPhase.RETRYING, 1, False)
    assert retrying.not_before is not None
    again = ledger.fail_step(uid, 1, 0, "HTTP 503", retryable=True, actor="worker")
    assert again.version == retrying.version  # repeated call
    _wait_until_due(ledger)
    assert ledger.promote_due() == [uid]
    running = ledger.get(uid)
    assert (running.phase, running.epoch) == (TaskPhase.RUNNING, 2)
    ledger.begin_step(uid, 2, 0, actor="worker")
    dead = ledger.fail_step(uid, 2, 0, "HTTP 503", retryable=True, actor="worker")
    assert (dead.phase, dead.reason, dead.dead_lettered, dead.failures) == (TaskPhase.FAILED, "RetriesExhausted", True, 2)
    assert ledger.promote_due() == []
    assert [(a.cause, a.outcome) for a in ledger.attempts(uid)] == [("first", "failed"), ("retry", "failed")]


def test_a_permanent_failure_fails_at_once_without_retry(ledger):
    uid = admitted(ledger, max_attempts=5)
    ledger.begin_step(uid, 1, 0, actor="worker")
    failed = ledger.fail_step(uid, 1, 0, "HTTP 400", retryable=False, actor="worker")
    assert (failed.phase, failed.reason, failed.dead_lettered) == (TaskPhase.FAILED, "PermanentError", False)


def test_requeue_gives_a_dead_letter_a_fresh_attempt_and_budget_recorded_in_history(ledger):
    uid = admitted(ledger, max_attempts=1)
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.fail_step(uid, 1, 0, "boom", retryable=True, actor="worker")
    requeued = ledger.requeue(uid, actor="cli:alice")
    assert (requeued.phase, requeued.epoch, requeued.failures, requeued.dead_lettered) == (TaskPhase.RUNNING, 2, 0, False)
    assert ("cli:alice", "requeue") in [(h.actor, h.event) for h in ledger.history(uid)]
    assert ledger.attempts(uid)[-1].cause == "requeue"


def test_a_lost_attempt_is_replaced_once_and_counts_as_a_disruption_not_a_failure(ledger):
    uid = admitted(ledger)
    replaced = ledger.replace_attempt(uid, 1, cause="lease-expired")
    repeat = ledger.replace_attempt(uid, 1, cause="lease-expired")
    assert (replaced.epoch, replaced.disruptions, replaced.failures) == (2, 1, 0)
    assert repeat.version == replaced.version
    assert [(a.cause, a.outcome) for a in ledger.attempts(uid)] == [("first", "lost"), ("lease-expired", None)]


def test_disruptions_beyond_their_cap_dead_letter_the_task(ledger):
    uid = admitted(ledger, max_disruptions=1)
    ledger.replace_attempt(uid, 1, cause="disruption")
    failed = ledger.replace_attempt(uid, 2, cause="disruption")
    assert (failed.phase, failed.reason, failed.dead_lettered) == (TaskPhase.FAILED, "DisruptionBudgetExhausted", True)


def test_a_future_not_before_schedules_without_dispatch_until_due(ledger, dsn):
    later = datetime.now(UTC) + timedelta(seconds=0.5)
    uid = admitted(ledger, not_before=later)
    assert ledger.get(uid).phase == TaskPhase.SCHEDULED
    assert count(dsn, "SELECT count(*) FROM retex.outbox") == 0
    assert ledger.next_due_at() == ledger.get(uid).not_before
    assert ledger.promote_due() == []
    _wait_until_due(ledger)
    assert ledger.promote_due() == [uid]
    assert count(dsn, "SELECT count(*) FROM retex.outbox") == 1


def test_cancel_is_immediate_for_a_waiting_task(ledger):
    uid = admitted(ledger, not_before=datetime.now(UTC) + timedelta(hours=1))
    cancelled = ledger.request_cancel(uid)
    assert (cancelled.phase, cancelled.reason) == (TaskPhase.CANCELLED, "Cancelled")
    assert ledger.request_cancel(uid).version == cancelled.version


def test_cancel_of_a_running_task_stops_its_worker_at_the_next_step_boundary(ledger):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.commit_step(uid, 1, 0, "ok", actor="worker")
    assert ledger.request_cancel(uid).phase == TaskPhase.RUNNING
    with pytest.raises(CancelRequested):
        ledger.begin_step(uid, 1, 1, actor="worker")
    assert ledger.finish_cancelled(uid, 1, actor="worker").phase == TaskPhase.CANCELLED


def test_a_lost_attempt_of_a_task_being_cancelled_ends_cancelled_not_replaced(ledger):
    uid = admitted(ledger)
    ledger.request_cancel(uid)
    record = ledger.replace_attempt(uid, 1, cause="lease-expired")
    assert (record.phase, record.epoch) == (TaskPhase.CANCELLED, 1)


def test_a_flagged_step_must_be_resolved_before_requeue_and_resolving_resumes_the_task(ledger):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    flagged = ledger.flag_step(uid, 1, 0, "started by attempt 1, not idempotent, no verify", actor="worker")
    assert (flagged.phase, flagged.steps[0].state) == (TaskPhase.NEEDS_ATTENTION, StepState.NEEDS_ATTENTION)
    with pytest.raises(IllegalTransition):
        ledger.requeue(uid, actor="cli:bob")
    resumed = ledger.resolve_step(uid, "charge", mark_done=True, result={"found": "ch_1"}, actor="cli:bob")
    assert (resumed.phase, resumed.epoch, resumed.steps[0].state) == (TaskPhase.RUNNING, 2, StepState.DONE)
    assert resumed.steps[0].result == {"found": "ch_1"}


def test_a_step_the_task_does_not_have_is_refused_as_step_not_found_and_nothing_moves(ledger):
    uid = admitted(ledger)
    with pytest.raises(StepNotFound) as unknown:
        ledger.resolve_step(uid, "refund", mark_done=True, result=None, actor="cli:bob")
    assert (unknown.value.uid, unknown.value.step) == (uid, "refund")
    with pytest.raises(StepNotFound) as beyond:
        ledger.begin_step(uid, 1, 3, actor="worker")
    assert beyond.value.step == 3
    assert [s.state for s in ledger.get(uid).steps] == [StepState.PENDING] * 3


def begun_earlier(dsn, uid, seconds):
    """The clock moves on: the task's step runs began `seconds` earlier than the ledger says."""
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE retex.steps SET started_at = started_at - make_interval(secs => %s) WHERE task_uid = %s",
                     (seconds, uid))


def test_resolving_by_rerun_puts_the_step_back_to_pending(ledger, dsn):
    uid = admitted(ledger)
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.flag_step(uid, 1, 0, "ambiguous", actor="worker")
    begun_earlier(dsn, uid, 3600)  # its run is long past its deadline
    resumed = ledger.resolve_step(uid, "charge", mark_done=False, actor="cli:bob")
    assert (resumed.phase, resumed.steps[0].state) == (TaskPhase.RUNNING, StepState.PENDING)


def test_a_rerun_is_refused_while_the_steps_latest_run_may_still_land_its_effect(ledger, dsn):
    """As the worker waits for a started step's deadline before it verifies or re-runs it
    (docs/crash-matrix.md), a human's re-run waits too: an http step of 20 s is sent within
    10 s of its begin or never, answered within 20 s of that, and 5 s of margin follow: 35 s."""
    task = replace(admission(steps=("charge",)), spec={"steps": [
        {"name": "charge", "timeoutSeconds": 20, "http": {"method": "POST", "url": "https://pay.example/charge"}}]})
    ledger.admit(task)
    ledger.begin_step(task.uid, 1, 0, actor="worker")
    ledger.flag_step(task.uid, 1, 0, "no response within 20s; not idempotent, no verify", actor="worker")
    begun = ledger.get(task.uid).steps[0].started_at
    history = ledger.history(task.uid)
    with pytest.raises(StepInFlight) as refused:
        ledger.resolve_step(task.uid, "charge", mark_done=False, actor="cli:bob")
    assert refused.value.rerun_from == begun + timedelta(seconds=35)
    assert 30 < refused.value.seconds_left <= 35
    assert "may still land its effect until" in str(refused.value)
    assert ledger.get(task.uid).steps[0].state == StepState.NEEDS_ATTENTION
    assert ledger.history(task.uid) == history
    begun_earlier(dsn, task.uid, 33)
    with pytest.raises(StepInFlight):
        ledger.resolve_step(task.uid, "charge", mark_done=False, actor="cli:bob")
    begun_earlier(dsn, task.uid, 3)
    resumed = ledger.resolve_step(task.uid, "charge", mark_done=False, actor="cli:bob")
    assert (resumed.phase, resumed.epoch, resumed.steps[0].state) == (TaskPhase.RUNNING, 2, StepState.PENDING)


def test_terminal_tasks_refuse_new_work(ledger):
    uid = admitted(ledger)
    run_all_steps(ledger, uid, 1)
    ledger.complete_task(uid, 1, actor="worker")
    with pytest.raises(IllegalTransition):
        ledger.requeue(uid, actor="cli:bob")
    assert ledger.replace_attempt(uid, 1, cause="lease-expired").phase == TaskPhase.SUCCEEDED
    assert ledger.fail_task(uid, reason="Timeout", message="late").phase == TaskPhase.SUCCEEDED


def test_history_is_append_only(ledger, dsn):
    admitted(ledger)
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.RaiseException, match="append-only"):
        conn.execute("UPDATE retex.history SET actor = 'mallory'")


def test_the_version_only_grows(ledger):
    uid = admitted(ledger)
    seen = [ledger.get(uid).version]
    for step in range(3):
        ledger.begin_step(uid, 1, step, actor="worker")
        seen.append(ledger.get(uid).version)
        ledger.commit_step(uid, 1, step, None, actor="worker")
        seen.append(ledger.get(uid).version)
    assert seen == sorted(set(seen))


def _wait_until_due(ledger, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        due = ledger.next_due_at()
        if due is None or due <= datetime.now(UTC):
            return
        time.sleep(0.02)
    raise AssertionError("nothing became due")
