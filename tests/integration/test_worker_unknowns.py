"""Outcomes that do not prove the effect did not happen, on a real ledger against the counting stub
(e2e/stub.py) in its non-deduplicating mode, where every execution shows: a gateway's 504 after
the upstream committed, an unexpected exception after the effect, a request still being processed
when the client gave up or when its worker was replaced. Never a blind second execution."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from e2e.stub import serve
from retex.ledger import Ledger, TaskAdmission
from retex.machine import Backoff, StepState, TaskPhase
from retex.worker.attempt import Attempt, AttemptEnd, ExitCode
from retex.worker.drain import Drain
from retex.worker.supervision import Supervision


class Lease:
    def still_held(self) -> bool:
        return True


class Counter:
    """The stub with --no-idempotency: every delivery is a real execution."""

    def __init__(self, tmp_path: Path):
        self.server = serve(0, tmp_path / "counts.json", idempotent=False)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def executions(self, key: str) -> int:
        with urllib.request.urlopen(f"{self.url}/counts") as response:
            return json.load(response).get(f"charge/{key}", {}).get("executions", 0)

    def arrivals(self, key: str) -> int:
        """Requests received so far, counted before the stub's delay: a charge in flight shows here."""
        with urllib.request.urlopen(f"{self.url}/arrivals") as response:
            return json.load(response).get(f"charge/{key}", 0)


@pytest.fixture
def counter(tmp_path):
    stub = Counter(tmp_path)
    yield stub
    stub.server.shutdown()
    stub.server.server_close()


def charge(counter: Counter, query: str = "", *, verify: bool = True, **fields) -> dict:
    step = {"name": "charge", "http": {"method": "POST", "url": f"{counter.url}/effects/charge{query}"}, **fields}
    if verify:
        step["verify"] = {"http": {"method": "GET", "url": f"{counter.url}/effects/charge"}}
    return step


def admit(ledger: Ledger, step: dict) -> str:
    uid = str(uuid.uuid4())
    ledger.admit(TaskAdmission(uid=uid, namespace="shop", name=f"order-{uid[:8]}", spec={"steps": [step]},
                               step_names=[step["name"]], backoff=Backoff(initial_seconds=0.01, max_seconds=0.05)))
    return uid


def run_attempt(ledger: Ledger, uid: str, epoch: int, env: dict | None = None) -> AttemptEnd:
    record = ledger.claim_attempt(uid, epoch, pod=f"pod-{epoch}", node=None)
    sup = Supervision(drain=Drain(30), kill_grace_seconds=0.5, **({"env": env} if env else {}))
    return Attempt(ledger, record, epoch=epoch, actor=f"worker:pod-{epoch}", lease=Lease(), supervision=sup,
                   verify_retry_seconds=0.05).run()


def test_a_504_after_the_effect_is_verified_and_committed_not_charged_again(ledger, counter):
    uid = admit(ledger, charge(counter, "?ack_status=504", timeoutSeconds=2))
    assert run_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "succeeded")
    record = ledger.get(uid)
    assert record.steps[0].result["verified"] is True
    assert counter.executions(record.steps[0].idempotency_key) == 1


def test_a_504_on_a_step_without_verify_asks_a_human_instead_of_retrying(ledger, counter):
    uid = admit(ledger, charge(counter, "?ack_status=504", verify=False))
    run_attempt(ledger, uid, 1)
    record = ledger.get(uid)
    assert (record.phase, record.steps[0].state) == (TaskPhase.NEEDS_ATTENTION, StepState.NEEDS_ATTENTION)
    assert "HTTP 504" in record.steps[0].error
    assert counter.executions(record.steps[0].idempotency_key) == 1


def test_a_status_the_step_declares_retryable_is_a_clean_failure_even_when_not_idempotent(ledger, counter):
    uid = admit(ledger, charge(counter, "?status=503", verify=False, retryableStatuses=[503]))
    run_attempt(ledger, uid, 1)
    assert ledger.get(uid).phase == TaskPhase.RETRYING


def test_an_unexpected_exception_after_the_effect_is_not_retried_blindly(ledger, tmp_path):
    counts = tmp_path / "counts"
    uid = admit(ledger, {"name": "charge", "python": {"callable": "tests.unit.worker_callables:unexpected_after_effect"}})
    repo = str(Path(__file__).resolve().parents[2])
    run_attempt(ledger, uid, 1, env={**os.environ, "PYTHONPATH": repo, "COUNTS": str(counts)})
    record = ledger.get(uid)
    assert record.phase == TaskPhase.NEEDS_ATTENTION and "KeyError" in record.steps[0].error
    assert counts.read_text().split() == [record.steps[0].idempotency_key]


def send_as_the_old_worker(url: str, key: str) -> threading.Thread:
    """Attempt 1's request, already on its way (a paused or partitioned worker's)."""

    def post() -> None:
        request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Idempotency-Key": key})
        with urllib.request.urlopen(request, timeout=30):
            pass

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_a_new_attempt_waits_for_the_old_attempts_step_deadline_before_verifying(ledger, counter):
    # Attempt 1's charge is still being processed (it lands 2 s after arrival, within the step's
    # 3 s timeout) when attempt 2 starts. Verifying at once would see 404 and charge again.
    step = charge(counter, "?delay=2", timeoutSeconds=3)
    uid = admit(ledger, step)
    ledger.begin_step(uid, 1, 0, actor="worker:pod-1")
    key = ledger.get(uid).steps[0].idempotency_key
    begun = time.monotonic()
    send_as_the_old_worker(step["http"]["url"], key)
    epoch = ledger.replace_attempt(uid, 1, cause="lease-expired").epoch
    assert run_attempt(ledger, uid, epoch) == AttemptEnd(ExitCode.OVER, "succeeded")
    assert counter.executions(key) == 1
    assert ledger.get(uid).steps[0].result["verified"] is True
    assert time.monotonic() - begun >= 3  # the verify ran after the step's deadline


def test_after_a_client_timeout_the_step_is_verified_only_after_its_deadline(ledger, counter):
    # The server is still processing when the client gives up at 1 s; the effect lands at 2.5 s.
    uid = admit(ledger, charge(counter, "?delay=2.5", timeoutSeconds=1))
    assert run_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "succeeded")
    record = ledger.get(uid)
    assert record.steps[0].result["verified"] is True
    assert counter.executions(record.steps[0].idempotency_key) == 1


class LeaseLostAfter:
    def __init__(self, seconds: float):
        self._until = time.monotonic() + seconds

    def still_held(self) -> bool:
        return time.monotonic() < self._until


def test_a_lease_lost_while_waiting_for_the_deadline_leaves_the_step_started_and_verifies_nothing(ledger, counter):
    uid = admit(ledger, charge(counter, "?ack_status=504", timeoutSeconds=30))
    record = ledger.claim_attempt(uid, 1, pod="pod-1", node=None)
    end = Attempt(ledger, record, epoch=1, actor="worker:pod-1", lease=LeaseLostAfter(2),
                  supervision=Supervision(drain=Drain(30)), verify_retry_seconds=0.05).run()
    step = ledger.get(uid).steps[0]
    assert end.code == ExitCode.DISRUPTED and "lease lost" in end.why
    assert (step.state, step.error) == (StepState.STARTED, None)
    assert counter.executions(step.idempotency_key) == 1


def test_a_run_started_after_waiting_out_an_old_begin_gets_its_own_full_deadline(ledger, counter):
    # Attempt 2 waits out attempt 1's begin, finds nothing, runs the charge itself and gives up
    # at 1 s while the stub is still processing: its verify must wait for *its run's* deadline,
    # not the (long past) one of the begin recorded in the ledger.
    uid = admit(ledger, charge(counter, "?delay=2.5", timeoutSeconds=1))
    ledger.begin_step(uid, 1, 0, actor="worker:pod-1")
    epoch = ledger.replace_attempt(uid, 1, cause="lease-expired").epoch
    assert run_attempt(ledger, uid, epoch) == AttemptEnd(ExitCode.OVER, "succeeded")
    record = ledger.get(uid)
    assert counter.executions(record.steps[0].idempotency_key) == 1
    assert record.steps[0].result["verified"] is True


class LeaseLostOnceSent:
    """Held until the stub has received the charge: the worker is replaced with its request in flight."""

    def __init__(self, counter: Counter, key: str):
        self._counter, self._key = counter, key

    def still_held(self) -> bool:
        return self._counter.arrivals(self._key) == 0


def test_a_run_after_a_verify_moves_the_step_deadline_so_the_next_attempt_waits_for_that_run(ledger, counter):
    # Attempt 2 waits out attempt 1's begin, verifies (not found) and only then sends the charge,
    # long after its own begin_step; it is replaced while the stub is still processing. Attempt 3
    # must wait from attempt 2's *run*, not its begin: verifying at once sees 404 and charges again.
    uid = admit(ledger, charge(counter, "?delay=2.5", timeoutSeconds=1))
    ledger.begin_step(uid, 1, 0, actor="worker:pod-1")
    key = ledger.get(uid).steps[0].idempotency_key
    epoch = ledger.replace_attempt(uid, 1, cause="lease-expired").epoch
    record = ledger.claim_attempt(uid, epoch, pod="pod-2", node=None)
    end = Attempt(ledger, record, epoch=epoch, actor="worker:pod-2", lease=LeaseLostOnceSent(counter, key),
                  supervision=Supervision(drain=Drain(30)), verify_retry_seconds=0.05).run()
    assert end.code == ExitCode.DISRUPTED and counter.arrivals(key) == 1  # replaced with the charge in flight
    assert counter.executions(key) == 0
    epoch = ledger.replace_attempt(uid, epoch, cause="lease-expired").epoch
    assert run_attempt(ledger, uid, epoch) == AttemptEnd(ExitCode.OVER, "succeeded")
    assert ledger.get(uid).steps[0].result["verified"] is True
    assert (counter.arrivals(key), counter.executions(key)) == (1, 1)


def test_a_request_sent_late_gets_the_servers_whole_timeout_before_it_is_verified(ledger, counter, monkeypatch):
    # A slow name lookup (7.5 s of the 8 s timeout) sends the charge late; the server then takes
    # 7.5 s, within the timeout it is allowed after receiving it: the effect lands ~15 s after the
    # begin. A verify at begin + timeout + margin (13 s) would see 404 and charge again.
    real_getaddrinfo, lookups = socket.getaddrinfo, []

    def slow_first_lookup(*args, **kwargs):
        lookups.append(args[0])
        if len(lookups) == 1:
            time.sleep(7.5)
        return real_getaddrinfo(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_first_lookup)
    uid = admit(ledger, charge(counter, "?delay=7.5", timeoutSeconds=8))
    assert run_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "succeeded")
    record = ledger.get(uid)
    assert record.steps[0].result["verified"] is True
    assert counter.executions(record.steps[0].idempotency_key) == 1
