"""The attempt lifecycle on the rig: purged tasks are not run again, a Job that fails before its
worker takes the lease is a disruption (up to the cap), worker pods that never start end their
attempt with Kubernetes' reason, cancel and delete without a worker end at once, a
deleted namespace finishes terminating, a timed-out task keeps its key until its old attempt
is known dead, and a worker seen dead is replaced without waiting for its lease to expire."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import UTC, datetime, timedelta

import pytest

from e2e.system import wait_for
from retex.kube.objects import job_name, lease_name
from retex.operator.reaper import LATE_RENEWAL_FRACTION
from tests.cluster.gates import ask_once, beat_until_killed
from tests.cluster.test_crash_matrix import submit, worker_died_at
from tests.cluster.test_operator import apply, jobs_of, phase_is, sh, status, task

START_DEADLINE = 8  # RETEX_WORKER_START_DEADLINE_SECONDS for these tests


def operator_log_has(system, text: str) -> bool:
    return text in system.operator.log_path.read_text(errors="replace")


def test_a_task_purged_by_history_retention_is_not_run_again_after_an_operator_restart(retex, stubs):
    _, notifier = stubs  # counts every delivery as an execution: a second run shows
    retex.operator.restart(RETEX_HISTORY_RETENTION_DAYS="0.00002")  # about 1.7 s
    apply(retex, "once", [{"name": "notify", "http": {"method": "POST", "url": f"{notifier.url}/effects/notify"}}])
    wait_for(lambda: phase_is(retex, "once", "Succeeded"), timeout=60, what="Succeeded")
    uid = task(retex, "once")["metadata"]["uid"]
    assert notifier.for_task(uid)["notify"]["executions"] == 1
    retex.operator.restart(RETEX_HISTORY_RETENTION_DAYS="0.00002")  # its first round purges the task
    wait_for(lambda: retex.ledger.find(retex.namespace, "once") is None, timeout=30, what="purged")
    retex.operator.restart(RETEX_HISTORY_RETENTION_DAYS="0.00002")  # resume handler sees the Task again
    wait_for(lambda: operator_log_has(retex, "not admitted again") or retex.ledger.find(retex.namespace, "once"),
             timeout=60, what="the resume verdict")
    again = retex.ledger.find(retex.namespace, "once")
    assert again is None, f"admitted again: {again.phase} at epoch {again.epoch}"
    assert notifier.for_task(uid)["notify"]["executions"] == 1


def _missing_service_account(retex):
    retex.kubectl("delete", "serviceaccount", "retex-worker")
    return {}


def _unpullable_image(retex):
    return {"worker": {"image": "registry.invalid/retex-worker:none"}}


def _unschedulable(retex):
    return {"worker": {"nodeSelector": {"retex.dev/no-such-node": "true"}}}


def _pod_quota(retex):
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods"},
             "spec": {"hard": {"pods": "0"}}}
    retex.kubectl("apply", "-f", "-", input=json.dumps(quota))
    # Enforced once the quota controller has computed its usage.
    wait_for(lambda: json.loads(retex.kubectl("get", "resourcequota", "no-pods", "-o", "json").stdout)
             .get("status", {}).get("hard"), timeout=30, what="quota in force")
    return {}


@pytest.mark.parametrize("cause, make, expected", [
    pytest.param("missing worker ServiceAccount", _missing_service_account, ['serviceaccount "retex-worker" not found'],
                 id="ServiceAccount"),
    # A kubelet says ErrImagePull at first, ImagePullBackOff between its retries.
    pytest.param("image pull", _unpullable_image, ["ErrImagePull", "ImagePullBackOff"], id="ImagePullBackOff"),
    pytest.param("unschedulable", _unschedulable, ["Unschedulable"], id="Unschedulable"),
    pytest.param("pod quota", _pod_quota, ["FailedCreate"], id="FailedCreate"),
])
def test_a_worker_pod_that_never_starts_fails_its_attempt_with_the_reason_kubernetes_gives(
        retex, cause, make, expected):
    retex.operator.restart(RETEX_WORKER_START_DEADLINE_SECONDS=str(START_DEADLINE))
    spec = make(retex)
    apply(retex, "stuck", [sh("only", "echo never")], retry={"maxAttempts": 1}, **spec)
    wait_for(lambda: phase_is(retex, "stuck", "Failed"), timeout=START_DEADLINE + 60, what=f"Failed ({cause})")
    shown = status(retex, "stuck")
    said = [reason for reason in expected if reason in shown["lastError"]]
    assert said, shown["lastError"]
    assert {c["type"]: c["reason"] for c in shown["conditions"]}["Failed"] == "RetriesExhausted"
    described = retex.kubectl("describe", "task", "stuck").stdout
    assert said[0] in described, described
    record = retex.ledger.find(retex.namespace, "stuck")
    assert [a.outcome for a in retex.ledger.attempts(record.uid)] == ["failed"]
    assert not retex.ledger.running()  # its run slot is free


def test_a_job_that_fails_before_its_worker_takes_the_lease_is_a_disruption_up_to_the_cap(retex):
    # The worker runs as a ServiceAccount with no rights on Leases: it reads its task from the
    # ledger endpoint, is refused the Lease (403), exits 1, and its Job fails (backoffLimit 0)
    # without the attempt ever holding the Lease. Long before the start deadline (120 s).
    retex.kubectl("create", "serviceaccount", "no-lease-rights")
    apply(retex, "unleased", [sh("only", "echo never")], worker={"serviceAccountName": "no-lease-rights"},
          retry={"maxDisruptions": 1})
    wait_for(lambda: phase_is(retex, "unleased", "Failed"), timeout=90, what="Failed at the disruption cap")
    shown = status(retex, "unleased")
    conditions = {c["type"]: c for c in shown["conditions"]}
    assert conditions["Failed"]["reason"] == "DisruptionBudgetExhausted"
    assert conditions["DeadLettered"]["status"] == "True"
    assert shown["lastError"] == "attempt 2 lost (disruption); disruption cap reached", shown["lastError"]
    assert (shown["attempt"], shown["retries"], shown["disruptions"]) == (2, 0, 2)
    uid = task(retex, "unleased")["metadata"]["uid"]
    assert [(a.epoch, a.cause, a.outcome) for a in retex.ledger.attempts(uid)] == [
        (1, "first", "lost"), (2, "disruption", "lost")]
    # The path taken: each attempt's worker was refused the Lease and exited 1, never holding it.
    for epoch in (1, 2):
        ends = retex.rig.pod_ends(retex.namespace, job_name("unleased", uid, epoch))
        assert [end.exit_code for end in ends] == [1], ends
        assert "worker crashed" in ends[0].log and "Forbidden" in ends[0].log, ends[0].log[-2000:]
    lease = json.loads(retex.kubectl("get", "lease", lease_name("unleased", uid), "-o", "json").stdout)
    assert not lease["spec"].get("holderIdentity"), lease["spec"]
    assert not retex.ledger.running()  # its run slot is free


def test_a_worker_pod_waiting_only_for_capacity_past_the_start_deadline_is_not_failed(retex):
    # No node has 1000 CPUs: the scheduler says "Insufficient cpu", exactly as for a full node,
    # and an autoscaler could still add one that fits, so the attempt waits (docs/operator.md).
    retex.operator.restart(RETEX_WORKER_START_DEADLINE_SECONDS=str(START_DEADLINE))
    apply(retex, "big", [sh("only", "echo never")], retry={"maxAttempts": 1},
          worker={"resources": {"requests": {"cpu": "1000"}}})
    wait_for(lambda: retex.ledger.find(retex.namespace, "big"), timeout=30, what="admitted")
    uid = task(retex, "big")["metadata"]["uid"]
    wait_for(lambda: operator_log_has(retex, "only slow: waiting") or retex.ledger.get(uid).terminal,
             timeout=START_DEADLINE + 60, what="the reaper's verdict past the deadline")
    record = retex.ledger.get(uid)
    assert (record.phase, record.last_error) == ("Running", None)
    assert [a.outcome for a in retex.ledger.attempts(uid)] == [None]
    assert "Insufficient cpu" in retex.operator.log_path.read_text(errors="replace")
    retex.kubectl("patch", "task", "big", "--type=merge", "-p", '{"spec":{"cancel":true}}')
    wait_for(lambda: retex.ledger.get(uid).terminal, timeout=30, what="cancelled")  # not stuck for ever


@pytest.mark.parametrize("how", ["cancel", "delete"])
def test_cancel_or_delete_of_a_task_whose_worker_never_started_ends_it_at_once(retex, how):
    apply(retex, "no-worker", [sh("only", "echo never")], **_unpullable_image(retex))
    wait_for(lambda: "ImagePullBackOff" in retex.kubectl("get", "pods", "-o", "json").stdout, timeout=60,
             what="the pod stuck pulling")
    uid = task(retex, "no-worker")["metadata"]["uid"]
    if how == "cancel":
        retex.kubectl("patch", "task", "no-worker", "--type=merge", "-p", '{"spec":{"cancel":true}}')
    else:
        retex.kubectl("delete", "task", "no-worker", "--wait=false")
    # Long before the start deadline (the default, 120 s): nothing waits for a worker.
    wait_for(lambda: retex.ledger.get(uid).terminal, timeout=30, what="ended")
    record = retex.ledger.get(uid)
    assert (record.phase, record.reason) == ("Cancelled", "Cancelled" if how == "cancel" else "TaskDeleted")
    if how == "delete":
        wait_for(lambda: task(retex, "no-worker") is None, timeout=30, what="Task gone")


def test_deleting_a_namespace_with_running_tasks_finishes_without_anyone_touching_finalizers(retex):
    # Cluster-wide, as the Deployment runs: restricted to named namespaces, kopf 1.45.2 stops
    # watching a namespace once it is marked for deletion with no blocking condition yet (a race
    # with the namespace controller, seen on the rig) and never sees its Tasks' deletion.
    retex.operator.restart(RETEX_NAMESPACES="")
    names = ["long-0", "long-1"]
    for name in names:
        apply(retex, name, [sh("first", "sleep 60; echo one"), sh("second", "echo two")],
              lease={"durationSeconds": 5})
    for name in names:
        wait_for(lambda n=name: (status(retex, n).get("lease") or {}).get("holder"), timeout=60,
                 what=f"{name} held by its worker")
    uids = [task(retex, name)["metadata"]["uid"] for name in names]
    retex.rig.kubectl("delete", "namespace", retex.namespace, "--wait=false")
    wait_for(lambda: retex.rig.kubectl("get", "namespace", retex.namespace, check=False).returncode != 0,
             timeout=150, what="namespace gone")
    for uid in uids:
        record = retex.ledger.get(uid)
        assert record.phase == "Cancelled", (record.phase, record.reason)
        assert record.reason == "TaskDeleted"


def test_a_dispatch_into_a_terminating_namespace_ends_the_task_as_deleted_not_failed(retex):
    # The race CI met: a new attempt is dispatched after the namespace is marked for deletion but
    # before the namespace controller marks its Tasks. Without the controller manager the namespace
    # stays in that state, so the dispatch meets it for sure.
    retex.operator.restart(RETEX_NAMESPACES="")  # see the test above
    # Due well after the restarted operator leads (it first waits out its predecessor's election
    # Lease) and admits it: due sooner, it ran at once and was never seen Scheduled (CI run 2).
    not_before = (datetime.now(UTC) + timedelta(seconds=20)).isoformat().replace("+00:00", "Z")
    apply(retex, "late", [sh("only", "echo never")], notBefore=not_before)
    wait_for(lambda: phase_is(retex, "late", "Scheduled"), timeout=30, what="Scheduled")
    uid = task(retex, "late")["metadata"]["uid"]
    retex.rig.stop_controller_manager()
    try:
        retex.rig.kubectl("delete", "namespace", retex.namespace, "--wait=false")
        wait_for(lambda: retex.ledger.get(uid).terminal, timeout=60, what="ended")
        assert operator_log_has(retex, "dispatch dropped: namespace terminating")  # the path taken
        record = retex.ledger.get(uid)
        assert (record.phase, record.reason) == ("Cancelled", "TaskDeleted")
    finally:
        retex.rig.start_controller_manager()
    wait_for(lambda: retex.rig.kubectl("get", "namespace", retex.namespace, check=False).returncode != 0,
             timeout=150, what="namespace gone")


def test_a_timed_out_task_keeps_its_concurrency_key_until_its_old_attempt_is_known_dead(retex, gates):
    alive, started = gates(opened_now=True), gates(opened_now=True)
    # The slow step beats until it is killed (the Job's deadline, 10 s after the Timeout); 15 s
    # leaves a slow rig the time to start its pod before the Timeout.
    apply(retex, "slow", [{"name": "only", "exec": {"command": beat_until_killed(alive)}, "idempotent": True}],
          timeoutSeconds=15, concurrencyKey="k", lease={"durationSeconds": 5})
    wait_for(lambda: alive.last_asked(), timeout=60, what="slow step running")
    apply(retex, "next", [{"name": "only", "exec": {"command": ask_once(started)}}], concurrencyKey="k")
    wait_for(lambda: phase_is(retex, "next", "Succeeded"), timeout=120, what="next Succeeded")
    assert retex.ledger.find(retex.namespace, "slow").reason == "Timeout"
    last_beat, next_start = alive.last_asked(), started.last_asked()
    assert next_start is not None and next_start > last_beat, \
        f"next started {last_beat - (next_start or 0):.1f}s before the old step stopped"


def test_a_deleted_tasks_pod_stuck_terminating_on_a_lost_node_frees_its_key_a_lease_duration_after_its_lease_went(
        retex, gates):
    """Its Task timed out and was deleted (the Lease went with it) while its node was lost: no
    kubelet reports its pod's end, which stays Terminating for as long as the node is away. No
    worker of it can renew a Lease that is gone, so once a lease duration has passed since the
    reaper found it gone, the attempt is known dead and the next task of its key runs, that pod
    still Terminating."""
    lease_seconds = 20  # past the node's NotReady (about 10 s), so the next pod goes to the other node
    alive, started = gates(opened_now=True), gates(opened_now=True)
    apply(retex, "stranded", [{"name": "only", "exec": {"command": beat_until_killed(alive)}, "idempotent": True}],
          timeoutSeconds=20, concurrencyKey="k", lease={"durationSeconds": lease_seconds})
    wait_for(lambda: alive.last_asked(), timeout=60, what="step running")
    uid = task(retex, "stranded")["metadata"]["uid"]
    wait_for(lambda: retex.ledger.get(uid).reason == "Timeout", timeout=60, what="Timeout")
    node = retex.ledger.attempts(uid)[0].node
    retex.rig.kill_node(node)  # the fault: the node is lost with the worker's pod, while its Lease is held
    try:
        retex.kubectl("delete", "tasks.retex.dev", "stranded", "--wait=false")

        def pods() -> list[dict]:
            return json.loads(retex.kubectl("get", "pods", "-l", f"retex.dev/task-uid={uid}", "-o", "json").stdout)["items"]

        def stuck_terminating() -> bool:
            return any(p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running" for p in pods())

        wait_for(stuck_terminating, timeout=30, what="the worker's pod deleted and stuck Terminating")
        wait_for(lambda: not retex.kubectl("get", "lease", lease_name("stranded", uid), check=False).stdout,
                 timeout=30, what="the Lease gone with its Task")
        lease_gone_at = time.monotonic()
        apply(retex, "next", [{"name": "only", "exec": {"command": ask_once(started)}}], concurrencyKey="k")
        wait_for(lambda: phase_is(retex, "next", "Succeeded"), timeout=lease_seconds + 90, what="next Succeeded")
        assert time.monotonic() - lease_gone_at >= lease_seconds - 2, "settled before a lease duration without a Lease"
        assert stuck_terminating(), "the stranded pod ended before the next task ran: the fault did not hold"
        settled = [json.loads(line) for line in retex.operator.log_path.read_text(errors="replace").splitlines()
                   if "ended attempt is known dead" in line and uid in line]
        assert [line.get("hold") for line in settled] == ["never"], settled  # no Lease: not its expiry
    finally:
        retex.rig.restart_node(node)


def test_a_timed_out_task_whose_pod_never_started_loses_its_job_once_its_attempt_is_settled(retex):
    """No node has the label its worker needs: the pod stays Pending and the Lease is never taken.
    Once the Timeout ended the attempt, the reaper knows it dead and deletes the unfinished Job,
    whose pod would otherwise hold the namespace's quota until the Job's own deadline (10 s
    later) and the Job stay for its TTL (600 s)."""
    apply(retex, "unplaced", [sh("only", "echo never")], timeoutSeconds=5,
          worker={"nodeSelector": {"retex.dev/test": "nowhere"}})
    wait_for(lambda: jobs_of(retex, "unplaced"), timeout=60, what="Job created")
    wait_for(lambda: phase_is(retex, "unplaced", "Failed"), timeout=60, what="Failed")
    assert retex.ledger.find(retex.namespace, "unplaced").reason == "Timeout"
    pods = json.loads(retex.kubectl("get", "pods", "-l", f"retex.dev/task-uid={task(retex, 'unplaced')['metadata']['uid']}",
                                    "-o", "json").stdout)["items"]
    assert [p["status"]["phase"] for p in pods] in ([], ["Pending"]), "the fault: the worker never ran"
    wait_for(lambda: not jobs_of(retex, "unplaced"), timeout=30, what="Job deleted")


def test_an_operator_paused_longer_than_a_lease_condemns_no_live_worker(retex):
    apply(retex, "patient", [sh("only", "sleep 20; echo done", idempotent=True)], lease={"durationSeconds": 5})
    wait_for(lambda: (status(retex, "patient").get("lease") or {}).get("holder"), timeout=60, what="held")
    os.killpg(retex.operator.proc.pid, signal.SIGSTOP)  # the fault: the operator freezes for 3 durations
    try:
        time.sleep(15)
    finally:
        os.killpg(retex.operator.proc.pid, signal.SIGCONT)
    # On waking, every observation looks 15 s old; the worker renewed all along.
    wait_for(lambda: phase_is(retex, "patient", "Succeeded"), timeout=60, what="Succeeded")
    record = retex.ledger.find(retex.namespace, "patient")
    assert [(a.epoch, a.cause) for a in retex.ledger.attempts(record.uid)] == [(1, "first")]


def test_a_worker_killed_mid_step_is_replaced_as_soon_as_its_pod_ended_before_any_renewal_is_late(retex):
    """With a 120 s lease, attempt 1's worker dies by SIGKILL just after beginning its step; the
    kubelet (here the rig's node agent) reports its container terminated and the operator's pod
    watch sees it, so the reaper starts the next attempt at once: long before a renewal is late
    (a quarter of the lease, 30 s after the last one), when a look at the Job's pods would."""
    lease_seconds = 120
    submitted = submit(retex, "killed", [sh("only", "echo done", idempotent=True)], failpoint="after-begin=kill",
                       lease={"durationSeconds": lease_seconds})
    death = worker_died_at(retex, "after-begin", submitted)  # proves SIGKILL at the failpoint
    died_at = time.monotonic()
    wait_for(lambda: phase_is(retex, "killed", "Succeeded"), timeout=lease_seconds / 2, what="Succeeded")
    recovered = time.monotonic() - died_at
    assert operator_log_has(retex, "lease holder's pod terminated: not waiting for the lease to expire"), death.pod
    assert [(a.epoch, a.cause) for a in retex.ledger.attempts(submitted.uid)] == [(1, "first"), (2, "disruption")]
    late = lease_seconds * LATE_RENEWAL_FRACTION
    assert recovered < late - 10, f"{recovered:.1f}s after the worker's death: not before a renewal was late ({late:g}s)"
