"""What admission leaves final in the ledger: a refusal stands for its uid, and a purge frees
neither the uid nor the idempotencyKey of the purged task (the Task objects outlive the rows, and
kopf's resume handler asks again at every operator start)."""

import time

import pytest

from retex.ledger import Refusal, TaskNotFound, TaskRef
from tests.integration.ledger_helpers import admission, run_all_steps


def succeed_and_purge(ledger, task):
    ledger.admit(task)
    record = ledger.get(task.uid)
    run_all_steps(ledger, task.uid, record.epoch)
    ledger.complete_task(task.uid, record.epoch, actor="worker")
    time.sleep(0.01)
    assert ledger.purge_finished(older_than_seconds=0) == 1


def refusal_of(task, reason, message, generation=1):
    return Refusal(uid=task.uid, namespace=task.namespace, name=task.name, reason=reason, message=message,
                   generation=generation)


def test_a_refusal_is_final_for_its_uid_the_first_one_stands_and_admit_never_runs_it(ledger):
    task = admission()
    stored = ledger.refuse(refusal_of(task, "JobRejected", "the API server refuses its Job: forbidden"))
    assert ledger.refuse(refusal_of(task, "InvalidSpec", "something else", generation=2)) == stored
    assert ledger.refusal(task.uid) == stored
    assert ledger.prior_verdict(task).refusal == stored
    result = ledger.admit(task)  # the dry run passing now changes nothing
    assert (result.created, result.refusal) == (False, stored)
    with pytest.raises(TaskNotFound):
        ledger.get(task.uid)


def test_a_purge_does_not_free_the_idempotency_key_of_the_purged_task(ledger):
    first = admission(idempotency_key="order-7")
    succeed_and_purge(ledger, first)
    second = admission(idempotency_key="order-7")
    result = ledger.admit(second)
    assert result.created is False, f"admitted: {ledger.get(second.uid).phase}"
    assert result.duplicate_of == TaskRef(uid=first.uid, namespace=first.namespace, name=first.name)
    assert ledger.admit(admission(idempotency_key="order-7", namespace="other")).created  # per namespace


def test_the_prior_verdict_names_a_purge_a_duplicate_and_a_refusal_without_writing(ledger):
    purged = admission(idempotency_key="order-8")
    succeed_and_purge(ledger, purged)
    live = admission(idempotency_key="order-9")
    ledger.admit(live)
    assert ledger.prior_verdict(purged).purged
    assert ledger.prior_verdict(admission(idempotency_key="order-8")).duplicate_of.uid == purged.uid
    assert ledger.prior_verdict(admission(idempotency_key="order-9")).duplicate_of.uid == live.uid
    assert ledger.prior_verdict(admission(idempotency_key="order-10")) is None
    assert ledger.prior_verdict(admission()) is None
