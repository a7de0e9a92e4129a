"""The operator on the local rig with real workers: Pending → Running → Succeeded, lease expiry and
release to a new attempt, operator restarts at random moments, very long Task names."""

from __future__ import annotations

import json
import os
import random
import time

from e2e.rig import pki as pkilib
from e2e.system import discard_namespace, prepare_namespace, task_manifest, wait_for


def task(system, name):
    out = system.kubectl("get", "task", name, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def status(system, name) -> dict:
    return (task(system, name) or {}).get("status") or {}


def apply(system, name, steps, **spec):
    system.kubectl("apply", "-f", "-", input=task_manifest(name, steps, **spec))


def sh(name, script, **extra):
    return {"name": name, "exec": {"command": ["sh", "-c", script]}, **extra}


def jobs_of(system, name) -> list[dict]:
    uid = task(system, name)["metadata"]["uid"]
    return json.loads(system.kubectl("get", "jobs", "-l", f"retex.dev/task-uid={uid}", "-o", "json").stdout)["items"]


def phase_is(system, name, *phases):
    return status(system, name).get("phase") in phases


def test_a_multi_step_task_goes_from_pending_to_succeeded_showing_each_committed_step(retex):
    apply(retex, "pipeline", [sh(f"s{i}", f"sleep 1.5; echo step-{i}") for i in range(3)])
    seen = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        shown = status(retex, "pipeline")
        if shown.get("progress") and (not seen or seen[-1] != shown["progress"]):
            seen.append(shown["progress"])
        if shown.get("phase") == "Succeeded":
            break
        time.sleep(0.2)
    assert seen[-1] == "3/3" and status(retex, "pipeline")["phase"] == "Succeeded", retex.operator.log_tail()
    assert seen == sorted(seen), seen  # never backwards
    assert {"1/3", "2/3"} <= set(seen), f"each committed step should show as it lands: {seen}"
    retex.kubectl("wait", "--for=condition=Succeeded", "--timeout=10s", "task/pipeline")
    shown = status(retex, "pipeline")
    assert [s["state"] for s in shown["steps"]] == ["done"] * 3
    assert "lease" not in shown, "a finished task shows no lease holder"
    assert "step-2" in shown["steps"][2]["result"]
    columns = retex.kubectl("get", "task", "pipeline").stdout
    assert "Succeeded" in columns and "3/3" in columns


def test_a_worker_whose_renewals_stop_is_replaced_within_lease_ttl_plus_5s(retex):
    apply(retex, "stalled", [sh("slow", "sleep 8; echo slow-done", idempotent=True)], lease={"durationSeconds": 5})
    wait_for(lambda: (status(retex, "stalled").get("lease") or {}).get("holder"), timeout=60, what="lease taken")
    pod = status(retex, "stalled")["lease"]["holder"].rsplit(":", 1)[0]
    retex.rig.pause_pod(retex.namespace, pod)  # SIGSTOP: alive but silent, the worst case
    paused_at = time.monotonic()
    wait_for(lambda: status(retex, "stalled").get("attempt", 0) >= 2, timeout=30, what="attempt 2")
    replaced_after = time.monotonic() - paused_at
    assert replaced_after <= 5 + 5, f"replacement took {replaced_after:.1f}s"
    retex.rig.resume_pod(retex.namespace, pod)  # the zombie wakes up; the fence must stop it
    wait_for(lambda: phase_is(retex, "stalled", "Succeeded"), timeout=60, what="Succeeded")
    record = retex.ledger.find(retex.namespace, "stalled")
    commits = [h for h in retex.ledger.history(record.uid) if h.event == "step-commit"]
    assert [h.epoch for h in commits] == [record.epoch], "only the current attempt commits"
    assert record.failures == 0 and record.disruptions >= 1


def test_a_released_lease_is_replaced_at_once_without_waiting_for_expiry(retex):
    apply(retex, "evicted", [sh("first", "echo one"), sh("long", "sleep 3; echo two", idempotent=True),
                             sh("third", "echo three")], lease={"durationSeconds": 60})
    wait_for(lambda: (status(retex, "evicted").get("steps") or [{}])[0].get("state") == "done", timeout=60,
             what="first step committed")
    pod = status(retex, "evicted")["lease"]["holder"].rsplit(":", 1)[0]
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": retex.namespace}}
    evicted_at = time.monotonic()
    retex.rig.kubectl("create", "--raw", f"/api/v1/namespaces/{retex.namespace}/pods/{pod}/eviction",
                      "-f", "-", input=json.dumps(eviction))
    wait_for(lambda: status(retex, "evicted").get("attempt", 0) >= 2, timeout=40, what="attempt 2")
    assert time.monotonic() - evicted_at < 30, "a released lease must not wait out its 60 s duration"
    wait_for(lambda: phase_is(retex, "evicted", "Succeeded"), timeout=60, what="Succeeded")
    record = retex.ledger.find(retex.namespace, "evicted")
    assert (record.failures, record.disruptions) == (0, 1), "a disruption does not consume the retry budget"
    first_step_commits = [h for h in retex.ledger.history(record.uid) if h.event == "step-commit" and h.step_idx == 0]
    assert len(first_step_commits) == 1, "a committed step never runs again"


def test_operator_restarts_at_random_moments_still_converge_with_each_step_committed_once(retex):
    rng = random.Random(1234)
    names = [f"order-{i}" for i in range(4)]
    for name in names:
        apply(retex, name, [sh("a", "sleep 0.5; echo a"), sh("b", "sleep 0.5; echo b")])
    for _ in range(3):
        time.sleep(rng.uniform(0.5, 3.0))
        retex.operator.restart()
    for name in names:
        wait_for(lambda n=name: phase_is(retex, n, "Succeeded"), timeout=120, what=f"{name} Succeeded")
    for name in names:
        record = retex.ledger.find(retex.namespace, name)
        commits = [(h.step_idx) for h in retex.ledger.history(record.uid) if h.event == "step-commit"]
        assert sorted(commits) == [0, 1], f"{name}: {commits}"


def test_a_task_with_a_253_character_name_runs(retex):
    name = ("a" * 60 + ".") * 4 + "b" * 9
    assert len(name) == 253
    apply(retex, name, [sh("only", "echo long-name")])
    wait_for(lambda: phase_is(retex, name, "Succeeded"), timeout=60, what="Succeeded")


def test_an_operator_scoped_by_retex_namespaces_never_admits_a_task_of_another_namespace(retex):
    # The fixture's operator runs with RETEX_NAMESPACES=<its tenant namespace>.
    other = f"{retex.namespace}-unwatched"
    prepare_namespace(retex.rig.kubectl, other)
    try:
        retex.rig.kubectl("apply", "-n", other, "-f", "-", input=task_manifest("elsewhere", [sh("only", "echo no")]))
        apply(retex, "here", [sh("only", "echo yes")])
        wait_for(lambda: phase_is(retex, "here", "Succeeded"), timeout=60, what="the watched task Succeeded")
        # A full status resync (5 s here) and many relay rounds later, still untouched.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            assert retex.ledger.find(other, "elsewhere") is None, "admitted from an unwatched namespace"
            time.sleep(0.5)
        unwatched = json.loads(retex.rig.kubectl("get", "task", "elsewhere", "-n", other, "-o", "json").stdout)
        assert not unwatched.get("status") and not unwatched["metadata"].get("finalizers")
        assert not json.loads(retex.rig.kubectl("get", "jobs", "-n", other, "-o", "json").stdout)["items"]
    finally:
        discard_namespace(retex.rig.kubectl, other)


def test_a_ledger_ca_rotated_while_the_operator_runs_reaches_the_jobs_dispatched_after_it(retex, tmp_path):
    """A rotation that changes the CA (manifests/ledger-tls.sh run again) needs no operator restart:
    a Job dispatched after it carries the new CA, and its worker verifies the new serving pair."""
    apply(retex, "before", [sh("only", "echo before")])
    wait_for(lambda: phase_is(retex, "before", "Succeeded"), timeout=90, what="before Succeeded")
    served, rotated = retex.operator.ledger_tls, pkilib.ledger_serving(tmp_path / "rotated", retex.rig.pod_host)
    later = time.time() + 5  # a new mtime, whatever the clock's grain
    for mounted, new in ((served.crt("ledger"), rotated.crt("ledger")), (served.key("ledger"), rotated.key("ledger")),
                         (served.ca_crt, rotated.ca_crt)):  # the kubelet swaps a Secret's files at once
        mounted.write_bytes(new.read_bytes())
        os.utime(mounted, (later, later))
    apply(retex, "after", [sh("only", "echo after")])
    [job] = wait_for(lambda: jobs_of(retex, "after"), timeout=60, what="the Job of 'after'")
    [worker] = job["spec"]["template"]["spec"]["containers"]
    handed = {env["name"]: env.get("value") for env in worker["env"]}["RETEX_LEDGER_CA"]
    assert handed == rotated.ca_crt.read_text(), "the Job carries the CA the operator started with"
    wait_for(lambda: phase_is(retex, "after", "Succeeded", "Failed"), timeout=90, what="after ends")
    assert phase_is(retex, "after", "Succeeded"), (status(retex, "after"), retex.operator.log_tail())


def test_kubectl_wait_for_completed_returns_for_every_ending(retex):
    """One condition to wait on, whatever the outcome: Succeeded, Failed, Cancelled or Refused."""
    apply(retex, "ends-well", [sh("only", "echo done")])
    apply(retex, "ends-badly", [sh("only", "exit 3", permanentExitCodes=[3])])
    apply(retex, "never-starts", [sh("only", "echo never")], notBefore="2099-01-01T00:00:00Z")
    apply(retex, "too-big", [sh("only", "echo never")], payload={"blob": "x" * (65 * 1024)})
    wait_for(lambda: phase_is(retex, "never-starts", "Scheduled"), timeout=60, what="Scheduled")
    retex.kubectl("patch", "tasks.retex.dev", "never-starts", "--type=merge", "-p", '{"spec":{"cancel":true}}')
    outcomes = {"ends-well": "Succeeded", "ends-badly": "Failed", "never-starts": "Cancelled", "too-big": "Refused"}
    for name, outcome in outcomes.items():
        retex.kubectl("wait", "--for=condition=Completed", "--timeout=90s", f"tasks.retex.dev/{name}", timeout=100)
        completed = {c["type"]: c for c in status(retex, name)["conditions"]}["Completed"]
        assert (completed["status"], completed["reason"], status(retex, name)["phase"]) == ("True", outcome, outcome)
