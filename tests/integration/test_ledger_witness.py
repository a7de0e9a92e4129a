"""The Task as the ledger's witness, in the ledger: a frozen task is stepped on by nobody (its
worker's writes fenced, its dispatch held, no slot, no promotion, no timeout) until a human
recovers it, from what its status showed or afresh; and one install owns a ledger."""

import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from retex.ledger import FenceRejected, InstallMismatch, NotFrozen, Refusal, TaskRecord
from retex.machine import StepState, TaskPhase
from tests.integration.ledger_helpers import admission, admitted


def shown(phase, *, version, attempt=1, steps=(), conditions=(), retries=0, disruptions=0):
    """A Task's status as the status mirror writes it (the witness a freeze keeps)."""
    return {"phase": phase, "attempt": attempt, "ledgerVersion": version, "retries": retries,
            "disruptions": disruptions,
            "steps": [{"name": name, "state": state, "attempt": attempt, **({"result": result} if result else {})}
                      for name, state, result in steps],
            "conditions": [{"type": kind, "status": status, "reason": reason, "message": message,
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}
                           for kind, status, reason, message in conditions]}


def due_dispatches(dsn, uid) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM retex.outbox WHERE task_uid = %s AND sent_at IS NULL "
                            "AND (not_before IS NULL OR not_before <= now())", (uid,)).fetchone()[0]


def succeeded_shown(version):
    return shown("Succeeded", version=version, steps=[("charge", "done", '{"charged":42}'), ("ship", "done", "shipped"),
                                                      ("email", "done", None)],
                 conditions=[("Succeeded", "True", "Succeeded", ""), ("Completed", "True", "Succeeded", "Succeeded")])


def test_a_frozen_task_takes_no_worker_write_and_its_dispatch_is_held(ledger, dsn):
    uid = admitted(ledger)
    record = ledger.get(uid)
    assert record.phase == TaskPhase.RUNNING and due_dispatches(dsn, uid) == 1

    frozen = ledger.freeze(uid, reason="LedgerBehind", witness=shown("Running", version=40), shown_version=40)

    assert frozen.frozen_reason == "LedgerBehind" and frozen.version == 41, "past the version its Task showed"
    assert due_dispatches(dsn, uid) == 0, "its dispatch is held"
    with pytest.raises(FenceRejected, match="frozen: LedgerBehind"):
        ledger.begin_step(uid, record.epoch, 0, actor="worker")
    again = ledger.freeze(uid, reason="LedgerBehind", witness=shown("Running", version=90), shown_version=90)
    assert again.version == 41 and again.witness["ledgerVersion"] == 40, "a second freeze changes nothing"


def test_a_task_the_ledger_holds_at_the_version_shown_or_past_it_is_not_frozen(ledger):
    uid = admitted(ledger)
    version = ledger.get(uid).version

    assert ledger.freeze(uid, reason="LedgerBehind", witness=shown("Running", version=version),
                         shown_version=version).frozen_reason is None
    assert ledger.freeze(uid, reason="LedgerBehind", witness=shown("Running", version=version - 1),
                         shown_version=version - 1).frozen_reason is None


def test_a_frozen_queued_task_is_not_started_when_a_slot_comes_free(ledger, dsn):
    ledger.set_run_limits(max_running=1, max_running_per_namespace=None)
    holder = admitted(ledger)
    queued = admitted(ledger)
    assert ledger.get(queued).phase == TaskPhase.QUEUED
    ledger.freeze(queued, reason="LedgerBehind", witness=shown("Queued", version=9), shown_version=9)

    ledger.fail_task(holder, reason="Test", message="frees the slot")
    ledger.settle_attempt(holder, 1)  # known dead: its slot is free now
    ledger.set_run_limits(max_running=None, max_running_per_namespace=None)
    ledger.fill_slots()

    assert ledger.get(queued).phase == TaskPhase.QUEUED and due_dispatches(dsn, queued) == 0


def test_a_frozen_task_is_neither_promoted_nor_timed_out_and_wakes_no_promoter(ledger):
    scheduled = admitted(ledger, not_before=datetime.now(UTC) + timedelta(seconds=1))
    timed = admitted(ledger, timeout_seconds=1)
    assert ledger.get(scheduled).phase == TaskPhase.SCHEDULED and ledger.next_due_at() is not None
    for uid in (scheduled, timed):
        ledger.freeze(uid, reason="LedgerBehind", witness=shown("Running", version=50), shown_version=50)
    time.sleep(1.5)  # both due now, were they not frozen

    assert ledger.promote_due() == []
    assert (ledger.get(scheduled).phase, ledger.get(timed).phase) == (TaskPhase.SCHEDULED, TaskPhase.RUNNING)
    assert ledger.next_due_at() is None, "a frozen task is never due: the promoter would spin on it"


def test_a_frozen_task_keeps_its_concurrency_key(ledger):
    ledger.set_run_limits(max_running=1, max_running_per_namespace=None)
    other = admitted(ledger)
    head = admitted(ledger, concurrency_key="acct-1")
    behind_it = admitted(ledger, concurrency_key="acct-1")
    ledger.freeze(head, reason="LedgerBehind", witness=shown("Running", version=30), shown_version=30)

    ledger.fail_task(other, reason="Test", message="frees the slot")
    ledger.settle_attempt(other, 1)

    assert (ledger.get(head).phase, ledger.get(behind_it).phase) == (TaskPhase.QUEUED, TaskPhase.QUEUED), (
        "its Task showed it Running: its worker may be inside a step, and the key's next task waits")


def test_the_reaper_leaves_a_frozen_task_as_it_is(ledger):
    uid = admitted(ledger)
    ledger.freeze(uid, reason="LedgerBehind", witness=shown("Running", version=60), shown_version=60)
    before = ledger.get(uid)

    ledger.replace_attempt(uid, 1, cause="lease-expired")
    ledger.fail_unstarted(uid, 1, "never started")

    after = ledger.get(uid)
    assert (after.phase, after.epoch, after.disruptions, after.failures, after.version) == (
        before.phase, before.epoch, before.disruptions, before.failures, before.version)


def test_a_recovered_task_starts_past_the_epochs_the_cluster_still_knows_and_its_timeout_restarts(ledger):
    uid = admitted(ledger, timeout_seconds=2)
    ledger.freeze(uid, reason="LedgerBehind", witness=shown("Running", version=70, attempt=2), shown_version=70)
    time.sleep(2.5)  # frozen past its timeout

    record = ledger.recover(uid, from_status=True, actor="kube:alice", min_epoch=7)
    ledger.promote_due()

    assert (record.epoch, ledger.get(uid).phase) == (8, TaskPhase.RUNNING), "timed out from its new attempt on"


def test_a_lost_task_whose_key_a_resubmission_took_meanwhile_comes_back_frozen_without_it(ledger):
    resubmitted = admission(idempotency_key="order-7")
    ledger.admit(resubmitted)
    lost = admission(idempotency_key="order-7")

    record = ledger.admit_lost(lost, witness=succeeded_shown(12), shown_version=12)

    assert isinstance(record, TaskRecord) and record.frozen_reason == "LedgerLost"
    assert ledger.get(resubmitted.uid).phase == TaskPhase.RUNNING, "the key stays with the task that holds it"


def test_a_task_the_ledger_lost_comes_back_frozen_with_no_attempt(ledger, dsn):
    lost = admission()
    witness = succeeded_shown(12)

    record = ledger.admit_lost(lost, witness=witness, shown_version=12)

    assert isinstance(record, TaskRecord)
    assert (record.frozen_reason, record.phase, record.epoch, record.version) == ("LedgerLost", TaskPhase.PENDING, 0, 13)
    assert ledger.attempts(lost.uid) == [] and due_dispatches(dsn, lost.uid) == 0
    assert [h.event for h in ledger.history(lost.uid)] == ["admit", "freeze"]


def test_a_lost_task_whose_refusal_stands_is_not_admitted(ledger):
    lost = admission()
    ledger.refuse(Refusal(uid=lost.uid, namespace=lost.namespace, name=lost.name, reason="InvalidSpec",
                          message="bad", generation=1))

    verdict = ledger.admit_lost(lost, witness=succeeded_shown(3), shown_version=3)

    assert verdict.refusal is not None and verdict.refusal.reason == "InvalidSpec"


def test_recovery_from_status_keeps_a_task_shown_succeeded_ended_with_its_steps_done(ledger, dsn):
    lost = admission()
    ledger.admit_lost(lost, witness=succeeded_shown(12), shown_version=12)

    record = ledger.recover(lost.uid, from_status=True, actor="kube:alice")

    assert record.frozen_reason is None and record.phase == TaskPhase.SUCCEEDED and record.finished_at is not None
    assert [(s.state, s.result) for s in record.steps] == [
        (StepState.DONE, {"charged": 42}), (StepState.DONE, "shipped"), (StepState.DONE, None)]
    assert due_dispatches(dsn, lost.uid) == 0 and ledger.attempts(lost.uid) == []
    assert ledger.history(lost.uid)[-1].event == "recover"


def test_recovery_from_status_resumes_after_the_steps_shown_done_in_an_attempt_past_the_shown_one(ledger, dsn):
    uid = admitted(ledger)
    witness = shown("Running", version=30, attempt=4, steps=[("charge", "done", '"paid"'), ("ship", "started", None),
                                                             ("email", "pending", None)])
    ledger.freeze(uid, reason="LedgerBehind", witness=witness, shown_version=30)

    record = ledger.recover(uid, from_status=True, actor="kube:alice")

    assert record.phase == TaskPhase.RUNNING and record.epoch == 5, "past every epoch the Task showed"
    assert [s.state for s in record.steps] == [StepState.DONE, StepState.STARTED, StepState.PENDING]
    assert due_dispatches(dsn, uid) == 1, "only the new attempt's dispatch, not the frozen one's"
    assert [(a.epoch, a.outcome) for a in ledger.attempts(uid)] == [(1, "superseded"), (5, None)]
    with pytest.raises(FenceRejected):
        ledger.begin_step(uid, 1, 1, actor="worker")  # the fenced worker of before stays fenced


def test_recovery_afresh_runs_every_step_the_ledger_does_not_hold_as_done(ledger):
    lost = admission()
    ledger.admit_lost(lost, witness=succeeded_shown(12), shown_version=12)

    record = ledger.recover(lost.uid, from_status=False, actor="kube:alice")

    assert record.phase == TaskPhase.RUNNING and record.frozen_reason is None
    assert all(s.state == StepState.PENDING for s in record.steps)
    ledger.begin_step(lost.uid, record.epoch, 0, actor="worker")


@pytest.mark.parametrize("phase", ["Running", "Succeeded"])
def test_cancelling_or_deleting_a_frozen_task_decides_it_and_ends_the_freeze(ledger, dsn, phase):
    uid = admitted(ledger)
    if phase == "Succeeded":
        record = ledger.get(uid)
        for step in record.steps:
            ledger.begin_step(uid, record.epoch, step.idx, actor="worker")
            ledger.commit_step(uid, record.epoch, step.idx, None, actor="worker")
        ledger.complete_task(uid, record.epoch, actor="worker")
    ledger.freeze(uid, reason="LedgerBehind", witness=shown(phase, version=90), shown_version=90)

    record = ledger.request_cancel(uid, reason="TaskDeleted")

    assert record.frozen_reason is None and ledger.figures().frozen == 0
    assert ledger.history(uid)[-1 if phase == "Succeeded" else -2].event == "thaw"
    if phase == "Running":
        assert record.cancel_requested and due_dispatches(dsn, uid) == 1, (
            "its held dispatch released: the relay drops it for the cancel, ending the task")


def test_recovering_a_task_that_is_not_frozen_is_refused(ledger):
    uid = admitted(ledger)
    with pytest.raises(NotFrozen):
        ledger.recover(uid, from_status=True, actor="kube:alice")


def test_a_ledger_is_owned_by_the_first_install_and_refuses_another_unless_adopted(ledger):
    ledger.claim_install(uid="install-a", namespace="retex-system", adopt_from=None)
    ledger.claim_install(uid="install-a", namespace="retex-system", adopt_from=None)  # its restart

    with pytest.raises(InstallMismatch, match="belongs to the retex install install-a") as refused:
        ledger.claim_install(uid="install-b", namespace="other", adopt_from=None)
    assert "RETEX_ADOPT_LEDGER=install-a" in str(refused.value)
    with pytest.raises(InstallMismatch):
        ledger.claim_install(uid="install-b", namespace="other", adopt_from="install-c")

    with pytest.raises(InstallMismatch, match="was probably deleted") as same_namespace:
        ledger.claim_install(uid="install-z", namespace="retex-system", adopt_from=None)  # its Lease made anew
    assert "retex.dev/install-uid=install-a" in str(same_namespace.value)

    ledger.claim_install(uid="install-b", namespace="other", adopt_from="install-a")
    with pytest.raises(InstallMismatch):
        ledger.claim_install(uid="install-a", namespace="retex-system", adopt_from=None)
