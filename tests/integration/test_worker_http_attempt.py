"""http steps through the attempt loop on a real ledger, against a payment-like stub that dedupes
by Idempotency-Key and counts real executions apart from deliveries (crash-matrix R6 with http)."""

from __future__ import annotations

import threading
import uuid

import pytest

from retex.ledger import Ledger, TaskAdmission
from retex.machine import Backoff, StepState, TaskPhase
from retex.worker.attempt import Attempt, ExitCode
from retex.worker.drain import Drain
from retex.worker.supervision import Supervision
from tests.unit.worker_steps_helpers import HttpStub


class Payments:
    """POST /charges executes once per Idempotency-Key (a repeat is a delivery, answered from the
    record); GET /charges/by-key answers 200 with the charge, or 404 if that key never ran."""

    def __init__(self, stub: HttpStub):
        self.charges: dict[str, dict] = {}
        self.deliveries = 0
        self.lookup_status: int | None = None  # force an answer from the lookup (a broken verify)
        self._lock = threading.Lock()
        stub.reply = self.answer

    def execute(self, key: str) -> dict:
        with self._lock:
            self.deliveries += 1
            return self.charges.setdefault(key, {"charge": f"ch_{len(self.charges) + 1}", "key": key})

    def answer(self, handler):
        key = handler.headers["Idempotency-Key"]
        if handler.command == "POST":
            return 201, self.execute(key)
        if self.lookup_status is not None:
            return self.lookup_status, {"error": "lookup down"}
        return (200, self.charges[key]) if key in self.charges else (404, {"error": "no such charge"})


@pytest.fixture
def payments():
    stub = HttpStub()
    yield Payments(stub), stub
    stub.close()


def admit(ledger: Ledger, stub: HttpStub, **step_fields) -> str:
    uid = str(uuid.uuid4())
    step = {"name": "charge", "http": {"method": "POST", "url": stub.url("/charges"), "body": {"amount": 42}},
            "verify": {"http": {"method": "GET", "url": stub.url("/charges/by-key")}},
            "timeoutSeconds": 1, **step_fields}  # short: a verify waits until begin + timeout + margin
    ledger.admit(TaskAdmission(uid=uid, namespace="shop", name=f"order-{uid[:8]}", spec={"steps": [step]},
                               step_names=["charge"], backoff=Backoff(initial_seconds=0.01, max_seconds=0.05)))
    return uid


class HeldLease:
    """Stands in for the Lease (tested for real on the rig): always held."""

    def still_held(self) -> bool:
        return True


def run_attempt(ledger: Ledger, uid: str, epoch: int):
    record = ledger.claim_attempt(uid, epoch, pod=f"pod-{epoch}", node=None)
    return Attempt(ledger, record, epoch=epoch, actor=f"worker:pod-{epoch}", lease=HeldLease(),
                   supervision=Supervision(drain=Drain(30)), verify_retry_seconds=0.05).run()


def crash_after_begin(ledger: Ledger, uid: str) -> int:
    ledger.begin_step(uid, 1, 0, actor="worker:pod-1")
    return ledger.replace_attempt(uid, 1, cause="lease-expired").epoch


def test_charge_runs_once_and_its_response_is_the_result(ledger, payments):
    pay, stub = payments
    uid = admit(ledger, stub)
    assert run_attempt(ledger, uid, 1).code == ExitCode.OVER
    step = ledger.get(uid).steps[0]
    assert step.result == {"status": 201, "body": {"charge": "ch_1", "key": step.idempotency_key}}
    assert (len(pay.charges), pay.deliveries) == (1, 1)


def test_charge_done_but_ack_lost_is_found_by_the_verify_and_not_sent_again(ledger, payments):
    pay, stub = payments
    uid = admit(ledger, stub)
    epoch = crash_after_begin(ledger, uid)
    pay.execute(ledger.get(uid).steps[0].idempotency_key)  # attempt 1's request did land
    run_attempt(ledger, uid, epoch)
    step = ledger.get(uid).steps[0]
    assert ledger.get(uid).phase == TaskPhase.SUCCEEDED
    assert step.result == {"status": 200, "body": {"charge": "ch_1", "key": step.idempotency_key}, "verified": True}
    assert (len(pay.charges), pay.deliveries) == (1, 1)  # not delivered again


def test_charge_that_never_landed_is_sent_once(ledger, payments):
    pay, stub = payments
    uid = admit(ledger, stub)
    run_attempt(ledger, uid, crash_after_begin(ledger, uid))
    assert ledger.get(uid).phase == TaskPhase.SUCCEEDED
    assert (len(pay.charges), pay.deliveries) == (1, 1)


def test_a_verify_that_keeps_failing_asks_a_human_and_sends_nothing(ledger, payments):
    pay, stub = payments
    pay.lookup_status = 503
    uid = admit(ledger, stub)
    run_attempt(ledger, uid, crash_after_begin(ledger, uid))
    record = ledger.get(uid)
    assert record.phase == TaskPhase.NEEDS_ATTENTION and record.steps[0].state == StepState.NEEDS_ATTENTION
    assert pay.deliveries == 0
    assert sum(1 for r in stub.requests if r["method"] == "GET") == 3  # retried, then stopped


def test_a_declined_charge_fails_the_task_permanently(ledger, payments):
    _, stub = payments
    stub.reply = lambda handler: (402, {"error": "card declined"})
    uid = admit(ledger, stub)
    run_attempt(ledger, uid, 1)
    record = ledger.get(uid)
    assert (record.phase, record.reason) == (TaskPhase.FAILED, "PermanentError")
    assert "HTTP 402" in record.last_error


def test_a_header_value_http_cannot_encode_is_a_recorded_failure_not_a_crash(ledger, payments):
    # http.client encodes header values as latin-1; "€" raised inside the request thread and the
    # worker died after the step had begun, with nothing sent.
    pay, stub = payments
    uid = admit(ledger, stub)
    spec = ledger.get(uid).spec
    spec["steps"][0]["http"]["headers"] = {"X-Currency": "€"}
    uid2 = str(uuid.uuid4())
    ledger.admit(TaskAdmission(uid=uid2, namespace="shop", name=f"order-{uid2[:8]}", spec=spec,
                               step_names=["charge"], backoff=Backoff(initial_seconds=0.01, max_seconds=0.05)))
    assert run_attempt(ledger, uid2, 1).code == ExitCode.OVER
    record = ledger.get(uid2)
    assert (record.phase, record.reason) == (TaskPhase.FAILED, "PermanentError")
    assert "X-Currency" in record.steps[0].error and "nothing was sent" in record.steps[0].error
    assert stub.requests == []
