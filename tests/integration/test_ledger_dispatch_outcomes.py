"""The outbox relay's ledger side against a real Postgres: each claimed record is settled on its
own, so one record the API server refuses (for good or for now) never holds up the others; a
claimed record is no other relay's until its claim lapses, and a settlement writes only while the
record is still its claim's."""

import time

import psycopg
import pytest

from retex.ledger import Ledger, NotLeader
from retex.machine import TaskPhase
from tests.integration.ledger_helpers import admitted

CLAIM_SECONDS = 30.0  # no claim lapses during a test unless it says so


def outbox(dsn, uid):
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT outcome, attempts, not_before > now() AS waiting, last_error, sent_at "
                            "FROM retex.outbox WHERE task_uid = %s ORDER BY id", (uid,)).fetchall()


def dispatch_batch(ledger, *, claim_seconds=CLAIM_SECONDS):
    return ledger.dispatch_batch(limit=20, claim_seconds=claim_seconds)


def claim(ledger):
    batch, _ = dispatch_batch(ledger)
    return [d.task_uid for d in batch]


def lapse_claims(dsn):
    """As if every claim had lapsed: each unsent record is due now."""
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE retex.outbox SET not_before = now() WHERE sent_at IS NULL")


def test_a_rejected_dispatch_fails_its_task_with_the_servers_message_and_the_next_record_is_sent(ledger, dsn):
    poisoned, good = admitted(ledger), admitted(ledger)
    batch, outcomes = dispatch_batch(ledger)
    assert [d.task_uid for d in batch] == [poisoned, good]
    assert outcomes.rejected(batch[0], 'Job.batch "x" is invalid: spec.template...: must be less than or equal to cpu limit')
    assert outcomes.sent(batch[1], "good-job")
    failed = ledger.get(poisoned)
    assert (failed.phase, failed.reason, failed.dead_lettered) == (TaskPhase.FAILED, "JobRejected", False)
    assert "must be less than or equal to cpu limit" in failed.last_error
    assert [a.outcome for a in ledger.attempts(poisoned)] == ["failed"]
    assert outbox(dsn, poisoned)[0][0] == "rejected"
    assert ledger.get(good).phase == TaskPhase.RUNNING and ledger.attempts(good)[0].job_name == "good-job"
    lapse_claims(dsn)
    assert claim(ledger) == []


def test_a_deferred_dispatch_waits_out_its_own_backoff_while_the_others_are_claimed(ledger, dsn):
    busy, good = admitted(ledger), admitted(ledger)
    batch, outcomes = dispatch_batch(ledger)
    assert outcomes.deferred(batch[0], "ApiException: (503) Service Unavailable") == 1.0
    assert outbox(dsn, busy) == [(None, 1, True, "ApiException: (503) Service Unavailable", None)]
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE retex.outbox SET not_before = now() WHERE task_uid = %s", (good,))  # good's claim lapsed
    assert claim(ledger) == [good]  # the deferred record is not claimed until its time
    lapse_claims(dsn)
    batch, outcomes = dispatch_batch(ledger)
    assert [d.task_uid for d in batch] == [busy, good]
    assert outcomes.deferred(batch[0], "again") == 2.0  # its own backoff doubles
    assert ledger.get(busy).phase == TaskPhase.RUNNING  # a transient error costs the task nothing


def test_a_dispatch_of_a_task_cancelled_before_its_job_existed_is_dropped_and_the_task_ends_cancelled(ledger, dsn):
    cancelled, deleted = admitted(ledger), admitted(ledger)
    ledger.request_cancel(cancelled)  # Running (dispatched, no Job yet): only a flag until now
    assert ledger.get(cancelled).phase == TaskPhase.RUNNING
    batch, outcomes = dispatch_batch(ledger)
    assert [d.task_uid for d in batch] == [cancelled, deleted]
    assert outcomes.dropped(batch[0], reason=batch[0].cancel_reason)
    assert outcomes.dropped(batch[1], reason="TaskDeleted")
    for uid, reason in ((cancelled, "Cancelled"), (deleted, "TaskDeleted")):
        record = ledger.get(uid)
        assert (record.phase, record.reason) == (TaskPhase.CANCELLED, reason)
        assert [a.outcome for a in ledger.attempts(uid)] == ["cancelled"]
        assert outbox(dsn, uid)[0][0] == "dropped"
    lapse_claims(dsn)
    assert claim(ledger) == []


def deferred_since(dsn, uid):
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT deferred_since FROM retex.outbox WHERE task_uid = %s", (uid,)).fetchone()[0]


def test_a_dispatch_deferred_again_keeps_the_time_of_its_first_deferral_and_can_fail_as_dispatch_failed(ledger, dsn):
    busy = admitted(ledger)
    batch, outcomes = dispatch_batch(ledger)
    assert batch[0].deferred_seconds is None  # never deferred
    outcomes.deferred(batch[0], "ApiException: (500) failed calling webhook")
    first = deferred_since(dsn, busy)
    assert first is not None
    lapse_claims(dsn)
    batch, outcomes = dispatch_batch(ledger)
    assert batch[0].deferred_seconds >= 0
    outcomes.deferred(batch[0], "ApiException: (500) failed calling webhook, again")
    assert deferred_since(dsn, busy) == first  # the cap counts from the first deferral
    lapse_claims(dsn)
    batch, outcomes = dispatch_batch(ledger)
    assert outcomes.rejected(batch[0], "not dispatched for 600s; last error: ApiException: (500)",
                             reason="DispatchFailed")
    failed = ledger.get(busy)
    assert (failed.phase, failed.reason, failed.dead_lettered) == (TaskPhase.FAILED, "DispatchFailed", False)
    assert failed.last_error == "not dispatched for 600s; last error: ApiException: (500)"
    assert outbox(dsn, busy)[0][0] == "rejected"


def test_a_dispatch_of_a_task_whose_cancel_was_requested_is_handed_out_with_its_cancel_reason(ledger):
    # The relay decides, not the claim: a Job may exist for it (crash-matrix R3), and only the
    # relay can look; a deletion ends the task as TaskDeleted, not Cancelled.
    cancelled, deleted, running = admitted(ledger), admitted(ledger), admitted(ledger)
    ledger.request_cancel(cancelled)
    ledger.request_cancel(deleted, reason="TaskDeleted")
    batch, _ = dispatch_batch(ledger)
    assert {d.task_uid: d.cancel_reason for d in batch} == {cancelled: "Cancelled", deleted: "TaskDeleted",
                                                            running: None}


def test_a_dispatch_that_met_its_job_ends_the_attempt_unsettled_with_the_job_name(ledger, dsn):
    # Crash-matrix R3: the Job exists (its worker may be inside a step) though the record is unsent.
    dropped, rejected = admitted(ledger), admitted(ledger)
    batch, outcomes = dispatch_batch(ledger)
    outcomes.dropped(batch[0], reason="Cancelled", job_name="dropped-job")
    outcomes.rejected(batch[1], "not dispatched for 600s", reason="DispatchFailed", job_name="rejected-job")
    for uid, job in ((dropped, "dropped-job"), (rejected, "rejected-job")):
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT job_name, outcome, settled_at FROM retex.attempts WHERE task_uid = %s",
                               (uid,)).fetchone()
        assert row[0] == job and row[1] is not None and row[2] is None  # holds its slot until known dead
    assert [w.epoch for w in ledger.watched() if w.uid in (dropped, rejected) and not w.current] == [1, 1]


def test_a_claimed_record_is_no_other_relays_until_its_claim_lapses_and_then_the_later_claim_settles_it(ledger, dsn):
    """A relay that died (or stalled) holding its claim: the record waits for the claim to lapse,
    then another relay claims it; the first relay's settlement, if it ever comes, writes nothing."""
    uid = admitted(ledger)
    first, first_outcomes = dispatch_batch(ledger, claim_seconds=1.0)
    assert [d.task_uid for d in first] == [uid]
    assert claim(ledger) == []  # claimed: not due for anyone else
    time.sleep(1.2)
    second, second_outcomes = dispatch_batch(ledger)
    assert [d.task_uid for d in second] == [uid]
    assert not first_outcomes.sent(first[0], "job-of-the-first")
    assert first_outcomes.deferred(first[0], "late") is None
    assert not first_outcomes.dropped(first[0], reason="Cancelled")
    assert outbox(dsn, uid) == [(None, 0, True, None, None)]
    assert ledger.get(uid).phase == TaskPhase.RUNNING
    assert second_outcomes.sent(second[0], "job-of-the-second")
    assert ledger.attempts(uid)[0].job_name == "job-of-the-second"
    assert not second_outcomes.sent(second[0], "again")  # settled: a repeat writes nothing


def test_a_claim_that_lapsed_unclaimed_still_settles(ledger, dsn):
    """A slow relay whose claim lapsed while nobody else claimed the record settles it: the
    record is as its claim left it."""
    uid = admitted(ledger)
    batch, outcomes = dispatch_batch(ledger, claim_seconds=0.1)
    time.sleep(0.3)
    assert outcomes.sent(batch[0], "job")
    assert outbox(dsn, uid)[0][0] == "sent"


def test_a_deposed_leaders_claim_settles_nothing_and_its_successor_sends_the_record(dsn, ledger):
    with (Ledger(dsn, retry_for_seconds=5, leader_fenced=True) as old,
          Ledger(dsn, retry_for_seconds=5, leader_fenced=True) as new):
        old.take_term(lock_timeout_seconds=1.0)
        uid = admitted(old)
        batch, outcomes = old.dispatch_batch(limit=20, claim_seconds=2.0)
        new.take_term(lock_timeout_seconds=1.0)
        for settle in (lambda: outcomes.sent(batch[0], "old-job"), lambda: outcomes.deferred(batch[0], "late"),
                       lambda: outcomes.rejected(batch[0], "late", reason="DispatchFailed")):
            with pytest.raises(NotLeader):
                settle()
        assert outbox(dsn, uid) == [(None, 0, True, None, None)]  # still the old claim's, until it lapses
        assert claim(new) == []
        time.sleep(2.2)
        batch, outcomes = new.dispatch_batch(limit=20, claim_seconds=CLAIM_SECONDS)
        assert [d.task_uid for d in batch] == [uid]
        assert outcomes.sent(batch[0], "new-job")
        assert ledger.attempts(uid)[0].job_name == "new-job"
