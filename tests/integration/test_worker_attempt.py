"""The worker's attempt loop against a real ledger on a real Postgres, with real step processes.

The external system is a counting stub: every real execution of an exec step appends the step's
idempotency key to a file, so "executed exactly once" is counted, not assumed. The Lease is stood
in for by a plain object here (these tests isolate step and ledger logic); the real Lease is
exercised on the rig in tests/cluster/test_worker_*.py.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from retex.ledger import FenceRejected, Ledger, TaskAdmission
from retex.machine import Backoff, StepState, TaskPhase
from retex.worker.attempt import Attempt, AttemptEnd, ExitCode
from retex.worker.drain import Drain
from retex.worker.supervision import Supervision

PY = sys.executable
# The counting stub: one line per real execution, naming the idempotency key it ran with.
EFFECT = [PY, "-c", "import os; open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]
# Query-first verify of the stub: exit 0 and print the key if it ran, the not-found code if not.
VERIFY = [PY, "-c", "import os, sys\n"
                    "key, path = os.environ['RETEX_IDEMPOTENCY_KEY'], os.environ['COUNTS']\n"
                    "ran = os.path.exists(path) and key in open(path).read().split()\n"
                    "print(key) if ran else sys.exit(int(os.environ['RETEX_NOT_FOUND_EXIT_CODE']))"]


class Lease:
    """Stands in for the worker's Lease: held until told otherwise."""

    def __init__(self, held: bool = True):
        self.held = held

    def still_held(self) -> bool:
        return self.held


class Stub:
    def __init__(self, path: Path):
        self.path = path

    def executions(self) -> list[str]:
        return self.path.read_text().split() if self.path.exists() else []

    def record(self, key: str) -> None:
        """An effect that happened, as a worker that died before committing would leave it."""
        with self.path.open("a") as f:
            f.write(key + "\n")


@pytest.fixture
def stub(tmp_path) -> Stub:
    return Stub(tmp_path / "executions")


def exec_step(name: str, stub: Stub, command=None, **fields) -> dict:
    env = [{"name": "COUNTS", "value": str(stub.path)}]
    return {"name": name, "exec": {"command": command or EFFECT, "env": env}, **fields}


def with_verify(name: str, stub: Stub, **fields) -> dict:
    # A short timeout: a verify of an interrupted step waits until begin + timeout + margin.
    verify = {"exec": {"command": VERIFY, "env": [{"name": "COUNTS", "value": str(stub.path)}]}}
    return exec_step(name, stub, verify=verify, **{"timeoutSeconds": 1, **fields})


def admit(ledger: Ledger, steps: list[dict], *, max_attempts: int = 3, payload: dict | None = None) -> str:
    uid = str(uuid.uuid4())
    spec = {"steps": steps, **({"payload": payload} if payload else {})}
    ledger.admit(TaskAdmission(uid=uid, namespace="shop", name=f"order-{uid[:8]}", spec=spec,
                               step_names=[s["name"] for s in steps], max_attempts=max_attempts,
                               backoff=Backoff(initial_seconds=0.01, max_seconds=0.05)))
    return uid


def run_attempt(ledger: Ledger, uid: str, epoch: int, *, lease: Lease | None = None,
                drain: Drain | None = None) -> AttemptEnd:
    record = ledger.claim_attempt(uid, epoch, pod=f"pod-{epoch}", node="node-1")
    return Attempt(ledger, record, epoch=epoch, actor=f"worker:pod-{epoch}", lease=lease or Lease(),
                   supervision=Supervision(drain=drain or Drain(30), kill_grace_seconds=0.5),
                   verify_retry_seconds=0.05).run()


def interrupted_at_first_step(ledger: Ledger, uid: str, stub: Stub, *, effect_happened: bool) -> int:
    """Attempt 1 begins step 0 (and maybe performs its effect), then dies before committing; the
    operator starts attempt 2. Returns the new epoch."""
    ledger.begin_step(uid, 1, 0, actor="worker:pod-1")
    if effect_happened:
        stub.record(ledger.get(uid).steps[0].idempotency_key)
    return ledger.replace_attempt(uid, 1, cause="lease-expired").epoch


def test_a_fresh_attempt_runs_every_step_once_passes_results_on_and_succeeds(ledger, stub):
    show_results = [PY, "-c", "import os, json; print(json.dumps(json.load(open(os.environ['RETEX_RESULTS_FILE']))))"]
    uid = admit(ledger, [exec_step("charge", stub), exec_step("ship", stub), exec_step("report", stub, show_results)])
    end = run_attempt(ledger, uid, 1)
    record = ledger.get(uid)
    assert end == AttemptEnd(ExitCode.OVER, "succeeded")
    assert record.phase == TaskPhase.SUCCEEDED
    assert stub.executions() == [s.idempotency_key for s in record.steps[:2]]
    assert '"charge": {"exitCode": 0' in record.steps[2].result["stdout"]


def test_a_resumed_attempt_starts_after_the_completed_prefix_and_never_reruns_committed_steps(ledger, stub):
    uid = admit(ledger, [exec_step("charge", stub), exec_step("ship", stub), exec_step("email", stub)])
    ledger.begin_step(uid, 1, 0, actor="worker:pod-1")
    ledger.commit_step(uid, 1, 0, {"done": "by attempt 1"}, actor="worker:pod-1")
    epoch = ledger.replace_attempt(uid, 1, cause="lease-expired").epoch
    assert run_attempt(ledger, uid, epoch).code == ExitCode.OVER
    record = ledger.get(uid)
    assert record.phase == TaskPhase.SUCCEEDED
    assert record.steps[0].result == {"done": "by attempt 1"}
    assert stub.executions() == [record.steps[1].idempotency_key, record.steps[2].idempotency_key]


def test_interrupted_step_whose_verify_finds_the_effect_is_committed_without_running(ledger, stub):
    uid = admit(ledger, [with_verify("charge", stub), exec_step("ship", stub)])
    epoch = interrupted_at_first_step(ledger, uid, stub, effect_happened=True)
    assert run_attempt(ledger, uid, epoch).code == ExitCode.OVER
    record = ledger.get(uid)
    key = record.steps[0].idempotency_key
    assert record.phase == TaskPhase.SUCCEEDED
    assert stub.executions().count(key) == 1  # the effect of attempt 1 only
    assert record.steps[0].result["verified"] is True and record.steps[0].result["stdout"] == f"{key}\n"


def test_interrupted_step_whose_verify_finds_nothing_runs_once(ledger, stub):
    uid = admit(ledger, [with_verify("charge", stub)])
    epoch = interrupted_at_first_step(ledger, uid, stub, effect_happened=False)
    assert run_attempt(ledger, uid, epoch).code == ExitCode.OVER
    record = ledger.get(uid)
    assert record.phase == TaskPhase.SUCCEEDED
    assert stub.executions() == [record.steps[0].idempotency_key]
    assert "verified" not in record.steps[0].result


def test_interrupted_idempotent_step_without_verify_is_rerun_with_the_same_key(ledger, stub):
    uid = admit(ledger, [exec_step("charge", stub, idempotent=True)])
    epoch = interrupted_at_first_step(ledger, uid, stub, effect_happened=True)
    assert run_attempt(ledger, uid, epoch).code == ExitCode.OVER
    key = ledger.get(uid).steps[0].idempotency_key
    assert ledger.get(uid).phase == TaskPhase.SUCCEEDED
    assert stub.executions() == [key, key]  # delivered twice, one key: the external system dedupes


def test_interrupted_step_neither_verifiable_nor_idempotent_stops_for_a_human_and_runs_nothing(ledger, stub):
    uid = admit(ledger, [exec_step("charge", stub), exec_step("ship", stub)])
    epoch = interrupted_at_first_step(ledger, uid, stub, effect_happened=False)
    end = run_attempt(ledger, uid, epoch)
    record = ledger.get(uid)
    assert end.code == ExitCode.OVER and end.why.startswith("needs attention")
    assert record.phase == TaskPhase.NEEDS_ATTENTION
    assert record.steps[0].state == StepState.NEEDS_ATTENTION
    assert stub.executions() == []


def test_a_verify_that_cannot_tell_stops_for_a_human_rather_than_guessing(ledger, stub):
    broken_verify = {"exec": {"command": [PY, "-c", "raise SystemExit(2)"]}}
    uid = admit(ledger, [exec_step("charge", stub, verify=broken_verify, timeoutSeconds=1)])
    epoch = interrupted_at_first_step(ledger, uid, stub, effect_happened=False)
    run_attempt(ledger, uid, epoch)
    assert ledger.get(uid).phase == TaskPhase.NEEDS_ATTENTION
    assert stub.executions() == []


def test_a_fence_rejection_stops_the_worker_at_once(ledger, stub):
    slow = [PY, "-c", "import os, time; time.sleep(1); "
                      "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]
    uid = admit(ledger, [exec_step("charge", stub, slow), exec_step("ship", stub)])
    # While step 0 runs, the operator decides attempt 1 is lost and starts attempt 2.
    threading.Timer(0.3, ledger.replace_attempt, args=(uid, 1), kwargs={"cause": "lease-expired"}).start()
    end = run_attempt(ledger, uid, 1)
    record = ledger.get(uid)
    assert end.code == ExitCode.STALE
    assert record.epoch == 2 and record.steps[0].state == StepState.STARTED  # its commit was refused
    assert record.steps[1].state == StepState.PENDING
    assert stub.executions() == [record.steps[0].idempotency_key]  # step 1 never ran


def test_a_stale_epoch_cannot_even_claim_the_attempt(ledger, stub):
    uid = admit(ledger, [exec_step("charge", stub)])
    ledger.replace_attempt(uid, 1, cause="lease-expired")
    with pytest.raises(FenceRejected):
        ledger.claim_attempt(uid, 1, pod="zombie", node=None)


def test_a_lost_lease_stops_before_the_next_step(ledger, stub):
    uid = admit(ledger, [exec_step("charge", stub)])
    end = run_attempt(ledger, uid, 1, lease=Lease(held=False))
    assert end.code == ExitCode.DISRUPTED
    assert ledger.get(uid).steps[0].state == StepState.PENDING and stub.executions() == []


def test_a_drain_before_a_step_starts_nothing(ledger, stub):
    uid = admit(ledger, [exec_step("charge", stub)])
    drain = Drain(30)
    drain.begin()
    assert run_attempt(ledger, uid, 1, drain=drain).code == ExitCode.DISRUPTED
    assert ledger.get(uid).steps[0].state == StepState.PENDING


def test_a_drain_lets_the_running_step_commit_then_stops_before_the_next(ledger, stub):
    slow = [PY, "-c", "import os, time; time.sleep(0.6); "
                      "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]
    uid = admit(ledger, [exec_step("charge", stub, slow), exec_step("ship", stub)])
    drain = Drain(10)
    threading.Timer(0.2, drain.begin).start()
    end = run_attempt(ledger, uid, 1, drain=drain)
    record = ledger.get(uid)
    assert end.code == ExitCode.DISRUPTED
    assert [s.state for s in record.steps] == [StepState.DONE, StepState.PENDING]


def test_a_step_abandoned_at_the_drain_deadline_is_left_started_with_nothing_recorded(ledger, stub):
    uid = admit(ledger, [exec_step("charge", stub, [PY, "-c", "import time; time.sleep(60)"])])
    drain = Drain(0.3)

    def drain_once_the_step_began() -> None:  # on a loaded machine the begin may take longer than any fixed delay
        deadline = time.monotonic() + 30
        while ledger.get(uid).steps[0].state != StepState.STARTED and time.monotonic() < deadline:
            time.sleep(0.02)
        drain.begin()

    threading.Thread(target=drain_once_the_step_began, daemon=True).start()
    end = run_attempt(ledger, uid, 1, drain=drain)
    step = ledger.get(uid).steps[0]
    assert end.code == ExitCode.DISRUPTED
    assert (step.state, step.result, step.error) == (StepState.STARTED, None, None)


def test_a_permanent_failure_fails_the_task_and_a_retryable_one_schedules_a_retry(ledger, stub):
    fail_3 = [PY, "-c", "raise SystemExit(3)"]
    permanent = admit(ledger, [exec_step("charge", stub, fail_3, permanentExitCodes=[3])])
    retryable = admit(ledger, [exec_step("charge", stub, fail_3, retryableExitCodes=[3])])
    assert run_attempt(ledger, permanent, 1).code == ExitCode.OVER
    assert run_attempt(ledger, retryable, 1).code == ExitCode.OVER
    assert (ledger.get(permanent).phase, ledger.get(permanent).reason) == (TaskPhase.FAILED, "PermanentError")
    assert ledger.get(retryable).phase == TaskPhase.RETRYING


def test_an_exec_step_that_crashes_after_its_effect_is_verified_and_committed_not_run_again(ledger, stub):
    # `curl ... && jq ...` failing after the POST: exit 1 is no proof that nothing happened.
    effect_then_crash = [PY, "-c", "import os; "
                                   "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n'); "
                                   "raise SystemExit(1)"]
    uid = admit(ledger, [with_verify("charge", stub, command=effect_then_crash)])
    assert run_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "succeeded")
    assert ledger.get(uid).steps[0].result["verified"] is True
    assert len(stub.executions()) == 1


def test_a_timed_out_step_that_is_not_idempotent_goes_to_a_human_not_to_a_blind_retry(ledger, stub):
    hang = [PY, "-c", "import time; time.sleep(60)"]
    uid = admit(ledger, [exec_step("charge", stub, hang, timeoutSeconds=1)])
    end = run_attempt(ledger, uid, 1)
    assert end.code == ExitCode.OVER
    assert ledger.get(uid).phase == TaskPhase.NEEDS_ATTENTION


def test_a_timed_out_idempotent_step_is_a_retryable_failure(ledger, stub):
    hang = [PY, "-c", "import time; time.sleep(60)"]
    uid = admit(ledger, [exec_step("charge", stub, hang, timeoutSeconds=1, idempotent=True)])
    run_attempt(ledger, uid, 1)
    assert ledger.get(uid).phase == TaskPhase.RETRYING


def test_a_timed_out_step_whose_verify_finds_the_effect_is_committed(ledger, stub):
    effect_then_hang = [PY, "-c", "import os, time; "
                                  "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n'); "
                                  "time.sleep(60)"]
    uid = admit(ledger, [with_verify("charge", stub, timeoutSeconds=1) | {"exec": {
        "command": effect_then_hang, "env": [{"name": "COUNTS", "value": str(stub.path)}]}}])
    run_attempt(ledger, uid, 1)
    record = ledger.get(uid)
    assert record.phase == TaskPhase.SUCCEEDED and record.steps[0].result["verified"] is True
    assert len(stub.executions()) == 1


def test_cancel_requested_stops_at_the_next_step_boundary(ledger, stub):
    uid = admit(ledger, [exec_step("charge", stub)])
    ledger.request_cancel(uid)
    assert run_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "cancelled")
    assert ledger.get(uid).phase == TaskPhase.CANCELLED and stub.executions() == []


def test_a_python_step_gets_its_args_and_the_task_payload(ledger):
    repo = str(Path(__file__).resolve().parents[2])
    uid = admit(ledger, [{"name": "charge", "python": {"callable": "tests.unit.worker_callables:charge",
                                                       "args": {"amount": 5}}}], payload={"order": 7})
    record = ledger.claim_attempt(uid, 1, pod="pod-1", node=None)
    sup = Supervision(drain=Drain(30), env={**os.environ, "PYTHONPATH": repo})
    Attempt(ledger, record, epoch=1, actor="worker:pod-1", lease=Lease(), supervision=sup).run()
    done = ledger.get(uid)
    assert done.phase == TaskPhase.SUCCEEDED
    assert done.steps[0].result["payload"] == {"order": 7} and done.steps[0].result["amount"] == 5


def python_step(name: str, function: str, **fields) -> dict:
    return {"name": name, "python": {"callable": f"tests.unit.worker_callables:{function}"}, **fields}


def run_python_attempt(ledger: Ledger, uid: str, epoch: int, stub: Stub | None = None) -> AttemptEnd:
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": repo, **({"COUNTS": str(stub.path)} if stub else {})}
    record = ledger.claim_attempt(uid, epoch, pod=f"pod-{epoch}", node=None)
    return Attempt(ledger, record, epoch=epoch, actor=f"worker:pod-{epoch}", lease=Lease(),
                   supervision=Supervision(drain=Drain(30), env=env, kill_grace_seconds=0.5),
                   verify_retry_seconds=0.05).run()


def test_nul_bytes_in_exec_output_are_committed_replaced_and_marked(ledger, stub):
    # Postgres text and jsonb refuse NUL; the effect happened, so the step must still commit.
    nul_out = [PY, "-c", "import sys; sys.stdout.write('paid\\x00ok')"]
    uid = admit(ledger, [exec_step("charge", stub, nul_out)])
    assert run_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "succeeded")
    result = ledger.get(uid).steps[0].result
    assert result["stdout"] == "paid\ufffdok" and result["sanitized"] is True


def test_nan_and_infinity_in_a_python_result_are_committed_as_text_and_marked(ledger):
    uid = admit(ledger, [python_step("charge", "not_a_number")])
    assert run_python_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "succeeded")
    assert ledger.get(uid).steps[0].result == {"ratio": "NaN", "ceiling": "Infinity", "label": "a\ufffdb",
                                               "sanitized": True}


def test_a_failure_whose_error_text_has_nul_bytes_is_recorded_with_the_text_made_safe(ledger, stub):
    fail_3 = [PY, "-c", "import sys; sys.stderr.write('bad\\x00card'); sys.exit(3)"]
    uid = admit(ledger, [exec_step("charge", stub, fail_3, permanentExitCodes=[3])])
    assert run_attempt(ledger, uid, 1).code == ExitCode.OVER
    record = ledger.get(uid)
    assert record.phase == TaskPhase.FAILED
    assert "bad\ufffdcard" in record.steps[0].error and "replaced" in record.steps[0].error


def test_a_result_the_ledger_still_refuses_commits_a_marked_placeholder_instead_of_crashing(ledger, stub,
                                                                                              monkeypatch):
    # Whatever the sanitizer misses, Postgres refusing a result must not re-run a done effect:
    # with the sanitizer switched off, the real refusal of NUL stands in for such a case.
    monkeypatch.setattr("retex.worker.attempt.stored_result", lambda result: result)
    nul_out = [PY, "-c", "import sys; sys.stdout.write('paid\\x00ok')"]
    uid = admit(ledger, [exec_step("charge", stub, nul_out)])
    assert run_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "succeeded")
    result = ledger.get(uid).steps[0].result
    assert result["sanitized"] is True and "refused" in result["refused"]


def gone(pid: int, within: float = 2.0) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts as gone)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.02)
    return False


def test_a_lease_lost_while_a_step_runs_kills_the_step_at_once_and_records_nothing(ledger, stub, tmp_path):
    # The new attempt may start as soon as the lease is judged expired: the old step must be dead.
    pid_file = tmp_path / "pid"
    slow = [PY, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60); "
                      "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]
    uid = admit(ledger, [exec_step("charge", stub, slow)])
    lease = Lease()
    threading.Timer(1.0, setattr, args=(lease, "held", False)).start()
    started = time.monotonic()
    end = run_attempt(ledger, uid, 1, lease=lease)
    step = ledger.get(uid).steps[0]
    assert end.code == ExitCode.DISRUPTED and "lease lost" in end.why
    assert time.monotonic() - started < 5
    assert gone(int(pid_file.read_text()))  # killed, not left running
    assert (step.state, step.result, step.error) == (StepState.STARTED, None, None)
    assert stub.executions() == []


def test_a_replaced_attempt_cannot_record_a_run_start(ledger, stub):
    # start_run is the last fenced write before a re-run: a worker replaced meanwhile stops there.
    uid = admit(ledger, [with_verify("charge", stub)])
    ledger.begin_step(uid, 1, 0, actor="worker:pod-1")
    ledger.replace_attempt(uid, 1, cause="lease-expired")
    with pytest.raises(FenceRejected):
        ledger.start_run(uid, 1, 0, actor="worker:pod-1")
    assert ledger.get(uid).steps[0].state == StepState.STARTED


def test_an_attempt_records_one_run_start_per_step_however_often_it_asks(ledger, stub):
    # A step's code can call the endpoint with its pod's token: each start_run was a history row,
    # a version bump and a NOTIFY, without end. A repeat by the same attempt is a repeated call.
    uid = admit(ledger, [with_verify("charge", stub)])
    ledger.begin_step(uid, 1, 0, actor="worker:pod-1")
    ledger.start_run(uid, 1, 0, actor="worker:pod-1")
    started_at, version = ledger.get(uid).steps[0].started_at, ledger.get(uid).version
    for _ in range(50):
        ledger.start_run(uid, 1, 0, actor="worker:pod-1")
    assert [e.event for e in ledger.history(uid)].count("step-run") == 1
    assert (ledger.get(uid).steps[0].started_at, ledger.get(uid).version) == (started_at, version)


def test_a_spec_the_models_now_refuse_fails_the_task_permanently_instead_of_crashing_every_attempt(ledger, tmp_path):
    # Admitted before the API refused CR/LF in header values: the worker must end the task
    # cleanly (fenced, with the reason), never send it, never crash with exit 1 attempt after attempt.
    step = {"name": "charge", "http": {"method": "POST", "url": "http://127.0.0.1:9/charges",
                                       "headers": {"X-Note": "a\r\nX-Injected: 1"}}}
    uid = admit(ledger, [step])
    assert run_attempt(ledger, uid, 1) == AttemptEnd(ExitCode.OVER, "step failed (permanent): task Failed")
    record = ledger.get(uid)
    assert (record.phase, record.reason) == (TaskPhase.FAILED, "PermanentError")
    assert "steps.0.http.headers" in record.steps[0].error and "CR, LF or NUL" in record.steps[0].error
