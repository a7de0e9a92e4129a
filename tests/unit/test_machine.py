"""The task/step state machine and the backoff policy, exhaustively and without a database."""

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retex.machine import (
    STEP_TRANSITIONS,
    TASK_TRANSITIONS,
    TERMINAL_PHASES,
    Backoff,
    IllegalTransition,
    StepEvent,
    StepState,
    TaskEvent,
    TaskPhase,
    completed_prefix,
    step_transition,
    task_transition,
)

P, E = TaskPhase, TaskEvent

EXPECTED_TASK_MOVES = {
    (P.PENDING, E.SCHEDULE): P.SCHEDULED,
    (P.PENDING, E.ENQUEUE): P.QUEUED,
    (P.SCHEDULED, E.ENQUEUE): P.QUEUED,
    (P.RETRYING, E.ENQUEUE): P.QUEUED,
    (P.PENDING, E.START_ATTEMPT): P.RUNNING,
    (P.SCHEDULED, E.START_ATTEMPT): P.RUNNING,
    (P.QUEUED, E.START_ATTEMPT): P.RUNNING,
    (P.RETRYING, E.START_ATTEMPT): P.RUNNING,
    (P.RUNNING, E.REPLACE_ATTEMPT): P.RUNNING,
    (P.RUNNING, E.RETRY): P.RETRYING,
    (P.RUNNING, E.SUCCEED): P.SUCCEEDED,
    (P.RUNNING, E.NEED_ATTENTION): P.NEEDS_ATTENTION,
    (P.FAILED, E.REQUEUE): P.PENDING,
    (P.NEEDS_ATTENTION, E.REQUEUE): P.PENDING,
    **{(p, E.FAIL): P.FAILED for p in (P.PENDING, P.SCHEDULED, P.QUEUED, P.RUNNING, P.RETRYING, P.NEEDS_ATTENTION)},
    **{(p, E.CANCEL): P.CANCELLED for p in (P.PENDING, P.SCHEDULED, P.QUEUED, P.RUNNING, P.RETRYING, P.NEEDS_ATTENTION)},
}

EXPECTED_STEP_MOVES = {
    (StepState.PENDING, StepEvent.BEGIN): StepState.STARTED,
    (StepState.STARTED, StepEvent.BEGIN): StepState.STARTED,
    (StepState.FAILED, StepEvent.BEGIN): StepState.STARTED,
    (StepState.STARTED, StepEvent.COMMIT): StepState.DONE,
    (StepState.STARTED, StepEvent.FAIL): StepState.FAILED,
    (StepState.STARTED, StepEvent.FLAG): StepState.NEEDS_ATTENTION,
    (StepState.NEEDS_ATTENTION, StepEvent.RESOLVE_DONE): StepState.DONE,
    (StepState.NEEDS_ATTENTION, StepEvent.RESOLVE_RERUN): StepState.PENDING,
}


def test_the_task_table_is_exactly_the_documented_one():
    assert TASK_TRANSITIONS == EXPECTED_TASK_MOVES


def test_the_step_table_is_exactly_the_documented_one():
    assert STEP_TRANSITIONS == EXPECTED_STEP_MOVES


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(TaskPhase, TaskEvent)))
def test_every_task_phase_and_event_pair_is_either_legal_or_refused(phase, event):
    if (phase, event) in EXPECTED_TASK_MOVES:
        assert task_transition(phase, event) == EXPECTED_TASK_MOVES[(phase, event)]
    else:
        with pytest.raises(IllegalTransition):
            task_transition(phase, event)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(StepState, StepEvent)))
def test_every_step_state_and_event_pair_is_either_legal_or_refused(state, event):
    if (state, event) in EXPECTED_STEP_MOVES:
        assert step_transition(state, event) == EXPECTED_STEP_MOVES[(state, event)]
    else:
        with pytest.raises(IllegalTransition):
            step_transition(state, event)


def test_succeeded_and_cancelled_have_no_way_out_and_failed_only_requeue():
    for phase in (P.SUCCEEDED, P.CANCELLED):
        assert not [e for e in TaskEvent if (phase, e) in TASK_TRANSITIONS]
    assert [e for e in TaskEvent if (P.FAILED, e) in TASK_TRANSITIONS] == [E.REQUEUE]


def test_a_done_step_is_never_reopened():
    assert not [e for e in StepEvent if (StepState.DONE, e) in STEP_TRANSITIONS]


@given(st.lists(st.sampled_from(list(TaskEvent)), max_size=40))
def test_no_event_sequence_leaves_a_terminal_phase_except_an_explicit_requeue(events):
    phase = P.PENDING
    for event in events:
        try:
            new = task_transition(phase, event)
        except IllegalTransition:
            continue
        if phase in TERMINAL_PHASES:
            assert phase == P.FAILED and event == E.REQUEUE
        phase = new


@pytest.mark.parametrize(
    ("states", "prefix"),
    [
        ([], 0),
        (["done", "done", "pending"], 2),
        (["done", "started", "done"], 1),  # a later step done out of order does not extend the prefix
        (["pending", "done", "done"], 0),
        (["done", "done"], 2),
    ],
)
def test_completed_prefix_counts_only_leading_done_steps(states, prefix):
    assert completed_prefix(states) == prefix


def test_backoff_grows_exponentially_and_is_capped():
    policy = Backoff(initial_seconds=1, max_seconds=30, factor=2, full_jitter=False)
    assert [policy.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert Backoff(max_seconds=300).ceiling(10_000) == 300  # no overflow for huge retry numbers


def test_full_jitter_draws_uniformly_below_the_ceiling_from_the_injected_rng():
    policy = Backoff(initial_seconds=2, max_seconds=60, factor=3)
    first = [policy.delay(n, random.Random(7)) for n in range(1, 6)]
    again = [policy.delay(n, random.Random(7)) for n in range(1, 6)]
    assert first == again  # reproducible with the same seed
    rng = random.Random(1)
    draws = [policy.delay(3, rng) for _ in range(2000)]
    assert all(0 <= d <= 18 for d in draws)
    assert 8 < sum(draws) / len(draws) < 10  # the mean of U(0, 18) is 9


def test_backoff_refuses_retry_number_zero():
    with pytest.raises(ValueError):
        Backoff().ceiling(0)
