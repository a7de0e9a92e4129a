"""The crash-point matrix (../shared/crash-matrix.md, docs/crash-matrix.md): every row on the rig
with the real operator, real worker pods, real Postgres and a counting stub of the outside world.

Each row runs a control task (no crash) to its end, then the same task with the crash injected at
exactly one point, and asserts: (1) the same terminal phase and step results as the control,
(2) exactly one real execution per idempotency key at the stub, (3) terminal within the bound,
(4) the row's own behaviour.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from e2e.system import task_manifest, wait_for
from tests.cluster.test_operator import status, task

TERMINAL = ("Succeeded", "Failed", "Cancelled", "NeedsAttention")
BOUND_SECONDS = 90  # every task reaches a terminal phase (or NeedsAttention) within this


def order_steps(payments, notifier, **overrides) -> list[dict]:
    """charge (idempotent at the provider), ship (verifiable), notify (neither), email (exec)."""
    steps = [
        {"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge"}, "idempotent": True},
        {"name": "ship", "http": {"method": "POST", "url": f"{payments.url}/effects/ship"},
         "verify": {"http": {"method": "GET", "url": f"{payments.url}/effects/ship"}}},
        {"name": "notify", "http": {"method": "POST", "url": f"{notifier.url}/effects/notify"}},
        {"name": "email", "exec": {"command": ["sh", "-c", "sleep 1; echo sent"]}, "idempotent": True},
    ]
    for step in steps:
        step.update(overrides.get(step["name"], {}))
    return steps


def submit(system, name, steps, failpoint=None, **spec):
    manifest = yaml.safe_load(task_manifest(name, steps, **spec))
    if failpoint:
        manifest["metadata"]["annotations"] = {"retex.dev/failpoint": failpoint}
    system.kubectl("create", "-f", "-", input=json.dumps(manifest))
    return wait_for(lambda: (task(system, name) or {}).get("metadata", {}).get("uid"), timeout=10, what="uid")


def settle(system, name, phases=TERMINAL, bound=BOUND_SECONDS) -> dict:
    """Wait until the task's status shows one of `phases`, within the bound; return the status."""
    return wait_for(lambda: status(system, name) if status(system, name).get("phase") in phases else None,
                    timeout=bound, what=f"{name} in {phases}")


def outcome(system, uid) -> tuple[str, list]:
    """Phase and per-step (name, state, result) from the ledger, results made run-independent."""
    record = system.ledger.get(uid)

    def normal(result):
        if isinstance(result, dict):
            return {k: normal(v) for k, v in result.items() if k != "verified"}
        return result

    return str(record.phase), [(s.name, str(s.state), normal(s.result)) for s in record.steps]


def control(system, payments, notifier, **spec) -> tuple[str, list]:
    uid = submit(system, "control", order_steps(payments, notifier), **spec)
    settle(system, "control")
    return outcome(system, uid)


def assert_exactly_once(stub_counts: dict, effects=("charge", "ship", "notify")):
    assert {e: stub_counts.get(e, {}).get("executions") for e in effects} == {e: 1 for e in effects}, stub_counts


def effects_of(payments, notifier, uid):
    return {**payments.for_task(uid), **notifier.for_task(uid)}


def job_names(system, uid) -> list[str]:
    out = system.kubectl("get", "jobs", "-l", f"retex.dev/task-uid={uid}", "-o", "json").stdout
    return sorted(j["metadata"]["name"] for j in json.loads(out)["items"])


# -- operator side ------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "point"), [("R1", "before-admit"), ("R2", "after-admit"),
                                            ("R3", "after-job-create")])
def test_R1_R2_R3_operator_killed_around_admission_and_dispatch_converges_to_one_task_and_one_job(
        retex, stubs, row, point):
    payments, notifier = stubs
    expected = control(retex, payments, notifier)
    retex.operator.restart(RETEX_FAILPOINT=point)
    uid = submit(retex, "crash", order_steps(payments, notifier))
    wait_for(lambda: retex.operator.exited() is not None, timeout=30, what=f"operator to die at {point}")
    retex.operator.start()
    settle(retex, "crash")
    assert outcome(retex, uid) == expected
    assert_exactly_once(effects_of(payments, notifier, uid))
    assert len([t for t in retex.ledger.versions() if t == uid]) == 1
    assert [a.epoch for a in retex.ledger.attempts(uid)] == [1], "one attempt: the crash cost nothing"
    assert len(job_names(retex, uid)) == 1, "one Job: a repeated dispatch met AlreadyExists"


def test_R4_operator_killed_while_mirroring_status_recomputes_it_and_it_never_goes_backwards(retex, stubs):
    payments, notifier = stubs
    expected = control(retex, payments, notifier)
    retex.operator.restart(RETEX_FAILPOINT="in-status-mirror")
    uid = submit(retex, "crash", order_steps(payments, notifier))
    wait_for(lambda: retex.operator.exited() is not None, timeout=30, what="operator to die mirroring")
    shown_versions = []
    retex.operator.start()
    deadline = time.monotonic() + BOUND_SECONDS
    while time.monotonic() < deadline:
        shown = status(retex, "crash")
        if "ledgerVersion" in shown:
            shown_versions.append(shown["ledgerVersion"])
        if shown.get("phase") == "Succeeded" and shown.get("ledgerVersion") == retex.ledger.get(uid).version:
            break
        time.sleep(0.2)
    assert shown_versions == sorted(shown_versions), "status went backwards"
    assert status(retex, "crash")["ledgerVersion"] == retex.ledger.get(uid).version
    assert outcome(retex, uid) == expected
    assert_exactly_once(effects_of(payments, notifier, uid))


# -- worker side ----------------------------------------------------------------------------------

LEASE = {"durationSeconds": 5}


@pytest.mark.parametrize(("row", "point", "row_check"), [
    ("R5", "after-lease", None),
    ("R6-idempotent", "after-effect:charge", "charge-redelivered"),
    ("R6-verify", "after-effect:ship", "ship-verified"),
    ("R7", "after-commit:charge", None),
    ("R8", "in-commit:charge", None),
    ("R9", "before-complete", "nothing-rerun"),
])
def test_R5_to_R9_worker_killed_at_each_point_resumes_with_one_execution_per_key(
        retex, stubs, row, point, row_check):
    payments, notifier = stubs
    expected = control(retex, payments, notifier, lease=LEASE)
    uid = submit(retex, "crash", order_steps(payments, notifier), failpoint=point, lease=LEASE)
    settle(retex, "crash")
    assert outcome(retex, uid) == expected
    counts = effects_of(payments, notifier, uid)
    assert_exactly_once(counts)
    record = retex.ledger.get(uid)
    assert record.epoch == 2 and record.failures == 0, "the kill was a disruption, replaced once"
    commits = [h.step_idx for h in retex.ledger.history(uid) if h.event == "step-commit"]
    assert sorted(commits) == [0, 1, 2, 3], f"each step committed once: {commits}"
    if row_check == "charge-redelivered":
        assert counts["charge"]["deliveries"] == 2, "re-run with the same key, replayed by the provider"
    if row_check == "ship-verified":
        assert counts["ship"]["deliveries"] == 1, "verify found it: the step was not sent again"
        assert record.steps[1].result.get("verified") is True
    if row_check == "nothing-rerun":
        assert all(c["deliveries"] == 1 for c in counts.values()), counts


def test_R6_a_step_neither_idempotent_nor_verifiable_stops_for_a_human_and_never_reruns(retex, stubs):
    payments, notifier = stubs
    expected = control(retex, payments, notifier, lease=LEASE)
    uid = submit(retex, "crash", order_steps(payments, notifier), failpoint="after-effect:notify", lease=LEASE)
    shown = settle(retex, "crash", phases=("NeedsAttention",))
    assert {c["type"]: c["status"] for c in shown["conditions"]}["NeedsAttention"] == "True"
    assert notifier.for_task(uid)["notify"] == {"deliveries": 1, "executions": 1}, "zero extra executions"
    key = retex.ledger.get(uid).steps[2].idempotency_key
    # The human checks the notifier, finds the effect, and marks the step done with what it said.
    retex.ledger.resolve_step(uid, "notify", mark_done=True, result={"status": 200, "body": notifier.stored("notify", key)},
                              actor="cli:test")
    settle(retex, "crash", phases=("Succeeded",))
    assert outcome(retex, uid) == expected
    assert_exactly_once(effects_of(payments, notifier, uid))


def duplicate_job(system, uid, epoch, name):
    """A second Job for the same attempt: the same pod template under another name."""
    job = json.loads(system.kubectl("get", "job", "-l", f"retex.dev/task-uid={uid},retex.dev/epoch={epoch}",
                                    "-o", "json").stdout)["items"][0]
    template = job["spec"]["template"]
    for key in ("controller-uid", "batch.kubernetes.io/controller-uid", "job-name", "batch.kubernetes.io/job-name"):
        template["metadata"]["labels"].pop(key, None)
    copy = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": template}}
    system.kubectl("create", "-f", "-", input=json.dumps(copy))


def pod_exit_code(system, job_name):
    def terminated():
        out = json.loads(system.kubectl("get", "pods", "-l", f"job-name={job_name}", "-o", "json").stdout)
        for pod in out["items"]:
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                state = container.get("state", {}).get("terminated")
                if state:
                    return str(state["exitCode"])
        return None

    return int(wait_for(terminated, timeout=60, what=f"{job_name} pod to exit"))


def test_R10_two_pods_for_one_attempt_only_the_lease_holder_executes(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier, charge={"http": {"method": "POST", "url": f"{payments.url}/effects/charge"}})
    steps.insert(0, {"name": "warmup", "exec": {"command": ["sh", "-c", "sleep 3"]}, "idempotent": True})
    uid = submit(retex, "crash", steps, lease=LEASE)
    wait_for(lambda: (status(retex, "crash").get("lease") or {}).get("holder"), timeout=60, what="lease taken")
    duplicate_job(retex, uid, 1, "crash-duplicate")
    settle(retex, "crash", phases=("Succeeded",))
    assert pod_exit_code(retex, "crash-duplicate") == 3, "the duplicate exits as stale, touching nothing"
    assert_exactly_once(effects_of(payments, notifier, uid))
    assert retex.ledger.get(uid).epoch == 1


def test_R11_a_paused_zombie_is_fenced_when_it_resumes(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier, email={"exec": {"command": ["sh", "-c", "sleep 6; echo sent"]}})
    uid = submit(retex, "crash", steps, lease=LEASE)
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][:4] ==
             ["done", "done", "done", "started"], timeout=60, what="email step running")
    pod = status(retex, "crash")["lease"]["holder"].rsplit(":", 1)[0]
    retex.rig.pause_pod(retex.namespace, pod)
    wait_for(lambda: status(retex, "crash").get("attempt", 0) >= 2, timeout=20, what="attempt 2")
    settle(retex, "crash", phases=("Succeeded",))
    retex.rig.resume_pod(retex.namespace, pod)  # the zombie finishes its sleep and tries to commit
    time.sleep(8)
    history = retex.ledger.history(uid)
    assert not [h for h in history if h.epoch == 1 and h.event == "step-commit" and h.step_idx == 3], \
        "the zombie's commit must be rejected by the fence"
    assert_exactly_once(effects_of(payments, notifier, uid))


def test_R12_a_stale_pod_after_the_task_is_terminal_exits_with_no_side_effects(retex, stubs):
    payments, notifier = stubs
    uid = submit(retex, "crash", order_steps(payments, notifier))
    settle(retex, "crash", phases=("Succeeded",))
    before = effects_of(payments, notifier, uid)
    version = retex.ledger.get(uid).version
    job = json.loads(retex.kubectl("get", "job", "-l", f"retex.dev/task-uid={uid}", "-o", "json").stdout)["items"]
    if not job:
        pytest.fail("the attempt's Job should still exist (ttlSecondsAfterFinished is 600)")
    duplicate_job(retex, uid, 1, "crash-stale")
    assert pod_exit_code(retex, "crash-stale") == 3
    assert effects_of(payments, notifier, uid) == before
    assert retex.ledger.get(uid).version == version, "terminal is not re-entrant"


# -- platform ---------------------------------------------------------------------------------------


def test_R13_an_evicted_pod_hands_over_at_once_without_using_the_retry_budget(retex, stubs):
    payments, notifier = stubs
    expected = control(retex, payments, notifier, lease={"durationSeconds": 60})
    steps = order_steps(payments, notifier, email={"exec": {"command": ["sh", "-c", "sleep 1; echo sent"]}})
    steps.insert(3, {"name": "pack", "exec": {"command": ["sh", "-c", "sleep 4"]}, "idempotent": True})
    expected = (expected[0], expected[1][:3] + [("pack", "done", None)] + expected[1][3:])
    uid = submit(retex, "crash", steps, lease={"durationSeconds": 60})
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][3:4] == ["started"],
             timeout=60, what="pack running")
    pod = status(retex, "crash")["lease"]["holder"].rsplit(":", 1)[0]
    evicted_at = time.monotonic()
    retex.rig.kubectl("create", "--raw", f"/api/v1/namespaces/{retex.namespace}/pods/{pod}/eviction", "-f", "-",
                      input=json.dumps({"apiVersion": "policy/v1", "kind": "Eviction",
                                        "metadata": {"name": pod, "namespace": retex.namespace}}))
    wait_for(lambda: status(retex, "crash").get("attempt", 0) >= 2, timeout=40, what="attempt 2")
    assert time.monotonic() - evicted_at < 30, "no waiting for the 60 s lease to expire"
    settle(retex, "crash", phases=("Succeeded",))
    phase, steps_out = outcome(retex, uid)
    assert phase == expected[0]
    assert [(n, s) for n, s, _ in steps_out] == [(n, s) for n, s, _ in expected[1]]
    record = retex.ledger.get(uid)
    assert (record.failures, record.disruptions) == (0, 1)
    assert_exactly_once(effects_of(payments, notifier, uid))


def test_R14_a_lost_node_is_replaced_on_the_other_node_within_lease_ttl_plus_5s(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    steps.insert(3, {"name": "pack", "exec": {"command": ["sh", "-c", "sleep 8"]}, "idempotent": True})
    uid = submit(retex, "crash", steps, lease=LEASE)
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][3:4] == ["started"],
             timeout=60, what="pack running")
    node = retex.ledger.attempts(uid)[0].node
    assert node in retex.rig.nodes
    retex.rig.kill_node(node)
    lost_at = time.monotonic()
    try:
        wait_for(lambda: (retex.ledger.attempts(uid)[-1].epoch >= 2 and retex.ledger.attempts(uid)[-1].node),
                 timeout=LEASE["durationSeconds"] + 5 + 10, what="attempt 2 running")
        took = time.monotonic() - lost_at
        replacement = retex.ledger.attempts(uid)[-1]
        assert replacement.node != node
        assert took <= LEASE["durationSeconds"] + 5, f"replacement took {took:.1f}s"
        settle(retex, "crash", phases=("Succeeded",))
    finally:
        retex.rig.restart_node(node)
    assert_exactly_once(effects_of(payments, notifier, uid))
    assert retex.ledger.get(uid).failures == 0


def test_R15_a_postgres_restart_mid_run_loses_and_duplicates_nothing(retex, stubs, postgres):
    payments, notifier = stubs
    expected = control(retex, payments, notifier)
    steps = order_steps(payments, notifier)
    steps.insert(2, {"name": "pack", "exec": {"command": ["sh", "-c", "sleep 3"]}, "idempotent": True})
    uid = submit(retex, "crash", steps)
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][2:3] == ["started"],
             timeout=60, what="pack running")
    postgres.restart()
    settle(retex, "crash", phases=("Succeeded",))
    assert outcome(retex, uid)[0] == expected[0]
    commits = [h.step_idx for h in retex.ledger.history(uid) if h.event == "step-commit"]
    assert sorted(commits) == [0, 1, 2, 3, 4]
    assert_exactly_once(effects_of(payments, notifier, uid))


def test_R16_an_api_server_restart_within_the_lease_ttl_does_not_replace_the_attempt(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    steps.insert(2, {"name": "pack", "exec": {"command": ["sh", "-c", "sleep 6"]}, "idempotent": True})
    uid = submit(retex, "crash", steps, lease={"durationSeconds": 20})
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][2:3] == ["started"],
             timeout=60, what="pack running")
    retex.rig.restart_apiserver()
    settle(retex, "crash", phases=("Succeeded",))
    assert retex.ledger.get(uid).epoch == 1, "renewals retried; the attempt went on"
    assert_exactly_once(effects_of(payments, notifier, uid))


def test_R17_exhausted_retries_dead_letter_with_no_further_attempts_until_requeued(retex, stubs):
    payments, notifier = stubs
    steps = [{"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge?status=503"}}]
    uid = submit(retex, "crash", steps, retry={"maxAttempts": 2, "backoff": {"initialSeconds": 0.1, "maxSeconds": 0.2}})
    shown = settle(retex, "crash", phases=("Failed",))
    assert {c["type"]: c["status"] for c in shown["conditions"]}["DeadLettered"] == "True"
    time.sleep(3)
    assert retex.ledger.get(uid).epoch == 2, "no attempt after the dead letter"
    assert payments.for_task(uid)["charge"] == {"deliveries": 2, "executions": 0}
    retex.kubectl("annotate", "task", "crash", "retex.dev/requeue=1")
    wait_for(lambda: retex.ledger.get(uid).epoch == 3, timeout=30, what="a fresh attempt")
    settle(retex, "crash", phases=("Failed",))


def test_R18_a_permanent_error_fails_at_once_without_retry(retex, stubs):
    payments, notifier = stubs
    steps = [{"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge?status=400"}}]
    uid = submit(retex, "crash", steps, retry={"maxAttempts": 5})
    shown = settle(retex, "crash", phases=("Failed",))
    assert {c["type"]: c["reason"] for c in shown["conditions"]}["Failed"] == "PermanentError"
    assert retex.ledger.get(uid).epoch == 1
    assert payments.for_task(uid)["charge"] == {"deliveries": 1, "executions": 0}
