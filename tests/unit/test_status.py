"""Task.status as a pure function of a ledger record."""

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from retex.api import ConditionType, TaskStatus, find_condition
from retex.kube.leasewatch import LeaseObservation
from retex.ledger import StepRecord, TaskRecord
from retex.machine import StepState, TaskPhase
from retex.operator.events import EventLimiter
from retex.operator.status import as_merge_patch, compute_status, events_between

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def record(phase=TaskPhase.RUNNING, states=("done", "started", "pending"), **extra) -> TaskRecord:
    steps = tuple(
        StepRecord(idx=i, name=f"s{i}", state=StepState(s), attempt=1 if s != "pending" else None,
                   idempotency_key=f"u:s{i}:0", result={"n": i} if s == "done" else None, error=None,
                   started_at=T0 if s != "pending" else None, finished_at=T0 if s == "done" else None)
        for i, s in enumerate(states)
    )
    fields = dict(uid="u", namespace="ns", name="t", spec={}, spec_hash="h", phase=phase, reason=None,
                  dead_lettered=False, epoch=1, failures=0, disruptions=0, max_attempts=3, max_disruptions=10,
                  not_before=None, concurrency_key=None, priority=0, deadline_at=None, cancel_requested=False,
                  last_error=None, version=7, created_at=T0,
                  updated_at=T0, started_at=T0, finished_at=None, steps=steps)
    fields.update(extra)
    return TaskRecord(**fields)


def status(rec, previous=None, lease=None, now=T0) -> TaskStatus:
    return compute_status(rec, lease=lease, generation=1, previous=previous, now=now)


def test_progress_is_the_contiguous_done_prefix_over_the_total():
    shown = status(record(states=("done", "pending", "done")))
    assert (shown.progress, shown.completed_steps, shown.total_steps) == ("1/3", 1, 3)


def test_the_status_carries_the_ledger_version_it_mirrors_and_per_step_state():
    shown = status(record())
    assert shown.ledger_version == 7
    assert [(s.name, s.state, s.result) for s in shown.steps] == [
        ("s0", "done", '{"n":0}'), ("s1", "started", None), ("s2", "pending", None)]


def test_a_running_task_has_running_true_and_no_terminal_condition():
    conditions = status(record()).conditions
    assert find_condition(conditions, ConditionType.RUNNING).status == "True"
    assert find_condition(conditions, ConditionType.SUCCEEDED).status == "False"
    assert find_condition(conditions, ConditionType.ACCEPTED).status == "True"


def test_a_dead_lettered_task_shows_failed_and_dead_lettered_with_the_reason():
    rec = record(TaskPhase.FAILED, ("done", "failed", "pending"), reason="RetriesExhausted", dead_lettered=True,
                 last_error="HTTP 503", finished_at=T0)
    shown = status(rec)
    failed = find_condition(shown.conditions, ConditionType.FAILED)
    assert (failed.status, failed.reason, failed.message) == ("True", "RetriesExhausted", "HTTP 503")
    assert find_condition(shown.conditions, ConditionType.DEAD_LETTERED).status == "True"
    assert shown.completion_time == T0


def completed(shown: TaskStatus):
    found = find_condition(shown.conditions, ConditionType.COMPLETED)
    return found.status, found.reason


def test_completed_is_true_with_the_outcome_as_reason_for_every_ending():
    for phase in (TaskPhase.SUCCEEDED, TaskPhase.FAILED, TaskPhase.CANCELLED):
        shown = status(record(phase, ("done",) * 3, reason="SomeCause", finished_at=T0))
        assert completed(shown) == ("True", str(phase)), phase


def test_completed_is_false_with_the_phase_as_reason_until_the_end_including_needs_attention():
    # NeedsAttention is no ending: a human's resolve lets the task run on, and Completed never
    # goes from True back to False.
    for phase in (TaskPhase.PENDING, TaskPhase.SCHEDULED, TaskPhase.QUEUED, TaskPhase.RUNNING,
                  TaskPhase.RETRYING, TaskPhase.NEEDS_ATTENTION):
        assert completed(status(record(phase))) == ("False", str(phase)), phase


def test_completed_says_why_a_failed_task_ended():
    shown = status(record(TaskPhase.FAILED, ("done", "failed", "pending"), reason="RetriesExhausted",
                          last_error="HTTP 503", finished_at=T0))
    assert find_condition(shown.conditions, ConditionType.COMPLETED).message == "RetriesExhausted: HTTP 503"


def test_completed_flips_once_when_the_task_ends():
    running = status(record(), now=T0)
    later = T0 + timedelta(minutes=5)
    done = status(record(TaskPhase.SUCCEEDED, ("done",) * 3, reason="Completed"), previous=running, now=later)
    assert find_condition(done.conditions, ConditionType.COMPLETED).last_transition_time == later
    assert find_condition(running.conditions, ConditionType.COMPLETED).last_transition_time == T0


def test_last_transition_time_moves_only_when_a_condition_flips():
    first = status(record(), now=T0)
    later = T0 + timedelta(minutes=5)
    same = status(replace(record(), version=8), previous=first, now=later)
    assert find_condition(same.conditions, ConditionType.RUNNING).last_transition_time == T0
    done = status(record(TaskPhase.SUCCEEDED, ("done",) * 3, reason="Completed"), previous=same, now=later)
    assert find_condition(done.conditions, ConditionType.RUNNING).last_transition_time == later
    assert find_condition(done.conditions, ConditionType.SUCCEEDED).last_transition_time == later


def test_the_lease_holder_is_shown_while_running():
    seen = LeaseObservation(task_uid="u", holder_pod="pod-a", holder_epoch=1, last_epoch=1, duration_seconds=15,
                            changed_at=0.0, changed_wall=T0.timestamp())
    shown = status(record(), lease=seen)
    assert (shown.lease.holder, shown.lease.renewed_at, shown.lease.duration_seconds) == ("pod-a:1", T0, 15)
    assert status(record(TaskPhase.SUCCEEDED, ("done",) * 3), lease=seen).lease is None


def test_events_name_the_first_sight_new_attempts_and_phase_changes():
    first = status(record())
    assert [e[0] for e in events_between(None, first)] == ["Accepted", "AttemptStarted"]
    second = status(replace(record(), epoch=2, version=9), previous=first)
    assert [e[0] for e in events_between(first, second)] == ["AttemptStarted"]
    failed = status(record(TaskPhase.FAILED, reason="PermanentError", last_error="HTTP 400"), previous=second)
    assert events_between(second, failed) == [("Failed", "HTTP 400", True)]


def test_an_attempt_that_ran_between_two_status_writes_still_gets_its_attempt_started_event():
    # The mirror writes what it finds; a short task can go Queued → Running → Succeeded between
    # two writes, and a retried one can start two attempts: each start is announced once.
    queued = status(record(TaskPhase.QUEUED, epoch=0, started_at=None, states=("pending",) * 3))
    succeeded = status(record(TaskPhase.SUCCEEDED, states=("done",) * 3, version=12), previous=queued)
    assert [e[:2] for e in events_between(queued, succeeded)] == [
        ("AttemptStarted", "attempt 1 dispatched"), ("Succeeded", "task Succeeded")]
    running = status(record(), previous=queued)
    third = status(record(TaskPhase.SUCCEEDED, epoch=3, states=("done",) * 3, version=20), previous=running)
    assert [e[:2] for e in events_between(running, third) if e[0] == "AttemptStarted"] == [
        ("AttemptStarted", "attempt 2 dispatched"), ("AttemptStarted", "attempt 3 dispatched")]
    assert [e[0] for e in events_between(third, third)] == []  # nothing new, nothing posted


def test_the_event_limiter_caps_a_crash_looping_task_per_window():
    limiter = EventLimiter(burst=3, window=60)
    assert [limiter.allow("u", t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert limiter.allow("other", 3)
    assert limiter.allow("u", 61)


def test_the_event_limiter_forgets_the_tasks_that_posted_nothing_for_a_window():
    limiter = EventLimiter(burst=3, window=60)
    for n in range(1000):
        limiter.allow(f"u{n}", n * 0.01)
    limiter.allow("late", 200)
    assert limiter.tasks_kept == 1


def test_the_merge_patch_deletes_what_is_no_longer_set():
    patch = as_merge_patch(status(record(TaskPhase.SUCCEEDED, ("done",) * 3, reason="Completed")))
    assert "lease" in patch and patch["lease"] is None  # the finished worker's lease goes away
    assert patch["phase"] == "Succeeded" and patch["ledgerVersion"] == 7
