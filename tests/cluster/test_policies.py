"""Policies on the rig, each also across an operator restart where it matters: dead letter and
requeue, permanent errors, delayed tasks, concurrency keys, run limits, cancel, delete, timeouts."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import yaml

from e2e.system import LEADER_ELECTION_FOR_TESTS, request_requeue, task_manifest, wait_for
from tests.cluster.gates import exit_until_open
from tests.cluster.test_operator import apply, phase_is, sh, status, task


def running_names(system) -> set[str]:
    """From the ledger, the truth: Task.status lags it by design, so two statuses may both still
    say Running for a moment after one task finished and the next started."""
    return {task.name for task in system.ledger.running()}


def test_exhausted_retries_dead_letter_the_task_and_a_requeue_annotation_runs_it_again(retex, gates):
    fixed = gates(opened_now=False)  # what was wrong outside, until the test fixes it
    apply(retex, "flaky", [{"name": "only", "exec": {"command": exit_until_open(fixed, 7)}, "retryableExitCodes": [7]}],
          retry={"maxAttempts": 2, "backoff": {"initialSeconds": 0.1, "maxSeconds": 0.2}})
    wait_for(lambda: phase_is(retex, "flaky", "Failed"), timeout=90, what="Failed")
    shown = status(retex, "flaky")
    conditions = {c["type"]: c for c in shown["conditions"]}
    assert conditions["DeadLettered"]["status"] == "True"
    assert conditions["Failed"]["reason"] == "RetriesExhausted"
    assert (shown["attempt"], shown["retries"]) == (2, 2)
    wait_for(lambda: "flaky" in retex.kubectl("get", "tasks", "-l", "retex.dev/dead-letter=true", "-o", "name").stdout,
             timeout=10, what="dead-letter label")
    fixed.open()
    admin = request_requeue(retex.kubectl, "flaky", "first")
    wait_for(lambda: phase_is(retex, "flaky", "Succeeded"), timeout=60, what="Succeeded after requeue")
    record = retex.ledger.find(retex.namespace, "flaky")
    assert (f"kube:{admin}", "requeue") in [(h.actor, h.event) for h in retex.ledger.history(record.uid)]
    assert retex.kubectl("get", "tasks", "-l", "retex.dev/dead-letter=true", "-o", "name").stdout.strip() == ""


def test_a_requeue_annotation_is_refused_while_a_step_awaits_a_human_and_the_task_ends_after_resolve(retex, stubs):
    _, notifier = stubs  # executes every delivery: a second run of the effect would count twice
    # Attempt 1's worker dies right after the notify effect (neither idempotent nor verifiable),
    # so attempt 2 finds it started and stops the task for a human.
    manifest = yaml.safe_load(task_manifest("needs-human", [
        {"name": "notify", "http": {"method": "POST", "url": f"{notifier.url}/effects/notify"}, "timeoutSeconds": 5},
        sh("after", "echo after", idempotent=True)], lease={"durationSeconds": 5}))
    manifest["metadata"]["annotations"] = {"retex.dev/failpoint": "after-effect:notify"}
    retex.kubectl("create", "-f", "-", input=json.dumps(manifest))
    wait_for(lambda: phase_is(retex, "needs-human", "NeedsAttention"), timeout=90, what="NeedsAttention")
    uid = task(retex, "needs-human")["metadata"]["uid"]
    assert notifier.for_task(uid)["notify"] == {"deliveries": 1, "executions": 1}

    request_requeue(retex.kubectl, "needs-human", "too-early")
    refusals = wait_for(lambda: events_of(retex, "needs-human", "RequeueRefused"), timeout=30,
                        what="the RequeueRefused Warning")
    assert "requeue before resolving step(s) notify" in refusals[0]["message"], refusals[0]["message"]
    record = retex.ledger.get(uid)
    assert (record.phase, record.epoch, str(record.steps[0].state)) == ("NeedsAttention", 2, "needs-attention")
    assert "annotation:too-early" not in {h.actor for h in retex.ledger.history(uid)}

    # The human finds the effect at the notifier and marks the step done: that requeues the task.
    key = record.steps[0].idempotency_key
    retex.ledger.resolve_step(uid, "notify", mark_done=True,
                              result={"status": 200, "body": notifier.stored("notify", key)}, actor="cli:test")
    wait_for(lambda: phase_is(retex, "needs-human", "Succeeded"), timeout=60, what="Succeeded after resolve")
    assert notifier.for_task(uid)["notify"] == {"deliveries": 1, "executions": 1}, "the effect ran once"
    record = retex.ledger.get(uid)
    assert [str(s.state) for s in record.steps] == ["done", "done"]
    # Attempt 1's worker was killed and seen dead: replaced as a disruption, before its lease expired.
    assert [(a.epoch, a.cause) for a in retex.ledger.attempts(uid)] == [(1, "first"), (2, "disruption"),
                                                                       (3, "requeue")]
    assert [h.actor for h in retex.ledger.history(uid) if h.event == "requeue"] == ["cli:test"]


def events_of(system, name, reason) -> list[dict]:
    return json.loads(system.kubectl("get", "events", "--field-selector", f"involvedObject.name={name},reason={reason}",
                                     "-o", "json").stdout)["items"]


def test_a_permanent_exit_code_fails_at_once_without_retry(retex):
    apply(retex, "doomed", [{"name": "only", "exec": {"command": ["sh", "-c", "exit 3"]}, "permanentExitCodes": [3]}],
          retry={"maxAttempts": 5})
    wait_for(lambda: phase_is(retex, "doomed", "Failed"), timeout=60, what="Failed")
    shown = status(retex, "doomed")
    assert (shown["attempt"], {c["type"]: c["reason"] for c in shown["conditions"]}["Failed"]) == (1, "PermanentError")


def test_a_delayed_task_waits_scheduled_and_fires_on_time_even_across_an_operator_restart(retex):
    # Far enough ahead that, on a loaded machine, admission shows Scheduled and the restarted
    # operator leads before the task is due (8 s was not: it went straight to Running under load).
    not_before = datetime.now(UTC) + timedelta(seconds=30)
    apply(retex, "later", [sh("only", "echo late")], notBefore=not_before.isoformat().replace("+00:00", "Z"))
    wait_for(lambda: phase_is(retex, "later", "Scheduled"), timeout=25, what="Scheduled")
    retex.operator.restart()
    wait_for(lambda: status(retex, "later").get("startTime"), timeout=60, what="started")
    started = datetime.fromisoformat(status(retex, "later")["startTime"].replace("Z", "+00:00"))
    # restart() is a SIGKILL: the new operator first waits out its dead predecessor's election
    # Lease (docs/operator.md, "High availability"), so "on time" allows that on top.
    waited_out = timedelta(seconds=float(LEADER_ELECTION_FOR_TESTS["RETEX_LEADER_LEASE_SECONDS"]))
    assert timedelta(0) <= started - not_before < waited_out + timedelta(seconds=2), started - not_before
    wait_for(lambda: phase_is(retex, "later", "Succeeded"), timeout=60, what="Succeeded")


def test_one_task_per_concurrency_key_runs_at_a_time_in_creation_order_across_a_restart(retex):
    names = [f"account-{i}" for i in range(3)]
    for i, name in enumerate(names):
        apply(retex, name, [sh("debit", "sleep 2; echo ok")], concurrencyKey="account-42", priority=10 * i)
        if i == 0:
            # The first must be admitted before the others exist: a backlog found at operator
            # start-up is admitted concurrently, and FIFO holds among admitted tasks only.
            wait_for(lambda: retex.ledger.find(retex.namespace, names[0]), timeout=30, what="first admitted")
        time.sleep(1.1)  # distinct creationTimestamps (one-second resolution): FIFO is by submission
    overlap = set()
    deadline = time.monotonic() + 120
    restarted = False
    while not all(phase_is(retex, n, "Succeeded") for n in names):
        assert time.monotonic() < deadline, "tasks did not finish"
        running = running_names(retex) & set(names)
        if len(running) > 1:
            overlap |= running
        if not restarted and phase_is(retex, names[1], "Running"):
            retex.operator.restart()
            restarted = True
        time.sleep(0.2)
    assert not overlap, f"ran at once: {overlap}"
    starts = [status(retex, n)["startTime"] for n in names]
    assert starts == sorted(starts), "FIFO by creation, whatever the priority"


def test_run_limits_hold_under_a_burst_and_lose_no_task(retex):
    retex.operator.restart(RETEX_MAX_RUNNING="2")
    names = [f"burst-{i}" for i in range(6)]
    for name in names:
        apply(retex, name, [sh("only", "sleep 1; echo done")])
    peak = 0
    deadline = time.monotonic() + 180
    while not all(phase_is(retex, n, "Succeeded") for n in names):
        assert time.monotonic() < deadline, "burst did not finish"
        peak = max(peak, len(running_names(retex)))
        time.sleep(0.2)
    assert 1 <= peak <= 2


def test_cancel_stops_a_running_task_at_the_next_step_boundary(retex):
    apply(retex, "cancel-me", [sh("first", "sleep 3; echo one"), sh("second", "echo two")])
    wait_for(lambda: (status(retex, "cancel-me").get("steps") or [{}])[0].get("state") == "started", timeout=60,
             what="first step running")
    retex.kubectl("patch", "task", "cancel-me", "--type=merge", "-p", '{"spec":{"cancel":true}}')
    wait_for(lambda: phase_is(retex, "cancel-me", "Cancelled"), timeout=60, what="Cancelled")
    steps = {s["name"]: s["state"] for s in status(retex, "cancel-me")["steps"]}
    assert steps == {"first": "done", "second": "pending"}


def test_deleting_a_running_task_waits_for_its_step_boundary_and_keeps_the_ledger_history(retex):
    apply(retex, "delete-me", [sh("first", "sleep 3; echo one"), sh("second", "echo two")])
    wait_for(lambda: (status(retex, "delete-me").get("steps") or [{}])[0].get("state") == "started", timeout=60,
             what="first step running")
    uid = task(retex, "delete-me")["metadata"]["uid"]
    retex.kubectl("delete", "task", "delete-me", "--wait=false")
    wait_for(lambda: task(retex, "delete-me") is None, timeout=60, what="Task gone")
    record = retex.ledger.get(uid)
    assert record.phase == "Cancelled"
    assert [s.state for s in record.steps] == ["done", "pending"]
    assert retex.ledger.history(uid)


def test_a_task_past_its_timeout_fails_with_reason_timeout(retex):
    apply(retex, "slowpoke", [sh("only", "sleep 30", idempotent=True)], timeoutSeconds=4)
    wait_for(lambda: phase_is(retex, "slowpoke", "Failed"), timeout=60, what="Failed")
    assert {c["type"]: c["reason"] for c in status(retex, "slowpoke")["conditions"]}["Failed"] == "Timeout"


def test_a_payload_over_the_limit_is_never_admitted_and_says_why(retex):
    """The API server cannot measure free-form JSON; the operator refuses it with Accepted=False."""
    apply(retex, "too-big", [sh("only", "echo never")], payload={"blob": "x" * (65 * 1024)})
    shown = wait_for(lambda: status(retex, "too-big").get("conditions"), timeout=30, what="a verdict")
    accepted = {c["type"]: c for c in shown}["Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("False", "InvalidSpec")
    assert "64 KiB" in accepted["message"] or "payload" in accepted["message"]
    assert retex.ledger.find(retex.namespace, "too-big") is None, "nothing admitted, nothing run"
    retex.kubectl("delete", "task", "too-big", "--timeout=30s")  # the finalizer lets an unadmitted task go
