"""The relay against the rig's real API server: one Task whose Job the API server refuses never
holds up the others; cancelled and deleted Tasks never get a Job."""

from __future__ import annotations

import json
from datetime import datetime

import yaml

from e2e.system import task_manifest, wait_for
from retex.kube.objects import LABEL_TASK_UID
from retex.operator.admission import admission_for

# Requests above limits: stored by the API server as a Task (the Task schema does not compare
# quantities), refused by it as a Job (422 "must be less than or equal to cpu limit").
REQUESTS_ABOVE_LIMITS = {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}
GOOD_TASKS = 30


def task(system, name):
    out = system.kubectl("get", "task", name, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def status(system, name) -> dict:
    return (task(system, name) or {}).get("status") or {}


def condition(system, name, kind) -> dict:
    return next((c for c in status(system, name).get("conditions") or [] if c["type"] == kind), {})


def echo(word):
    return [{"name": "say", "exec": {"command": ["sh", "-c", f"echo {word}"]}}]


def jobs_of(system, uid) -> list[str]:
    out = system.kubectl("get", "jobs", "-l", f"{LABEL_TASK_UID}={uid}", "-o", "name")
    return out.stdout.split()


def admitted_while_the_operator_is_down(system, name, steps, *, finalizer=False, **spec):
    """A Task in the ledger with its first dispatch waiting, as an operator that admitted it (an
    older one, without the Job dry run) and died before relaying left it."""
    manifest = yaml.safe_load(task_manifest(name, steps, **spec))
    if finalizer:
        manifest["metadata"]["finalizers"] = ["retex.dev/finalizer"]
    system.kubectl("create", "-f", "-", input=json.dumps(manifest))
    body = task(system, name)
    meta = body["metadata"]
    system.ledger.admit(admission_for(
        uid=meta["uid"], namespace=meta["namespace"], name=name, spec=body["spec"],
        submitted_at=datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))))
    return meta["uid"]


def test_one_task_whose_job_the_api_server_refuses_fails_alone_and_thirty_behind_it_finish(retex):
    retex.operator.kill()
    poisoned = admitted_while_the_operator_is_down(retex, "poisoned", echo("never"), worker=REQUESTS_ABOVE_LIMITS)
    manifests = "---\n".join(task_manifest(f"good-{i:02d}", echo(i)) for i in range(GOOD_TASKS))
    retex.kubectl("create", "-f", "-", input=manifests)
    # The poisoned record is first in the outbox; a run limit keeps the rig's load bounded.
    retex.operator.start(RETEX_MAX_RUNNING="8")

    def finished():
        phases = [status(retex, f"good-{i:02d}").get("phase") for i in range(GOOD_TASKS)]
        return phases.count("Succeeded") == GOOD_TASKS

    wait_for(finished, timeout=600, interval=2, what=f"{GOOD_TASKS} good tasks Succeeded")
    wait_for(lambda: status(retex, "poisoned").get("phase") == "Failed", timeout=30, what="poisoned Failed")
    failed = condition(retex, "poisoned", "Failed")
    assert failed["status"] == "True" and failed["reason"] == "JobRejected", failed
    assert "must be less than or equal to cpu limit" in failed["message"], failed
    assert "must be less than or equal to cpu limit" in status(retex, "poisoned")["lastError"]
    assert condition(retex, "poisoned", "DeadLettered")["status"] == "False"
    assert jobs_of(retex, poisoned) == []
    retex.kubectl("delete", "task", "poisoned", "--timeout=30s")


def test_dispatches_of_cancelled_and_terminating_tasks_are_dropped_without_a_job(retex):
    retex.operator.kill()
    cancelled = admitted_while_the_operator_is_down(retex, "cancelled", echo("never"))
    retex.kubectl("patch", "task", "cancelled", "--type=merge", "-p", '{"spec": {"cancel": true}}')
    terminating = admitted_while_the_operator_is_down(retex, "terminating", echo("never"), finalizer=True)
    retex.kubectl("delete", "task", "terminating", "--wait=false")
    assert task(retex, "terminating")["metadata"].get("deletionTimestamp")
    retex.operator.start()
    wait_for(lambda: status(retex, "cancelled").get("phase") == "Cancelled", timeout=60, what="cancelled")
    wait_for(lambda: task(retex, "terminating") is None, timeout=60, what="the terminating Task gone")
    assert retex.ledger.get(terminating).phase == "Cancelled"
    assert jobs_of(retex, cancelled) == [] and jobs_of(retex, terminating) == []
    assert [a.outcome for a in retex.ledger.attempts(cancelled)] == ["cancelled"]
