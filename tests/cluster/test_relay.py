"""The relay and admission against the rig's real API server: one Task whose Job the API server
refuses, for good or for now, never holds up the others; Jobs the API server would refuse are
refused at admission;
cancelled, deleted and duplicate Tasks never get a Job; a refusal is announced once."""

from __future__ import annotations

import base64
import contextlib
import json
import ssl
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from e2e.rig.pki import ledger_serving
from e2e.system import request_requeue, task_manifest, wait_for
from retex.kube.objects import LABEL_TASK_UID, job_name
from retex.ledger import TaskNotFound
from retex.operator.admission import admission_for

# Requests above limits: stored by the API server as a Task (the Task schema does not compare
# quantities), refused by it as a Job (422 "must be less than or equal to cpu limit").
REQUESTS_ABOVE_LIMITS = {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}
EXISTS_WITH_A_VALUE = {"tolerations": [{"key": "k", "operator": "Exists", "value": "x"}]}
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


def succeeded(system, name, *, timeout):
    wait_for(lambda: status(system, name).get("phase") == "Succeeded", timeout=timeout, what=f"{name} Succeeded")


def jobs_of(system, uid) -> list[str]:
    out = system.kubectl("get", "jobs", "-l", f"{LABEL_TASK_UID}={uid}", "-o", "name")
    return out.stdout.split()


def handled(system, name, handler: str, shown) -> bool:
    """kopf handled a change: its diff base shows it (`shown(base)`) and no progress record of
    `handler` is left (kopf keeps one while a handler keeps failing)."""
    annotations = task(system, name)["metadata"].get("annotations") or {}
    base = json.loads(annotations.get("kopf.retex.dev/last-handled-configuration", "{}"))
    return shown(base) and not [k for k in annotations if k.startswith("kopf.retex.dev/") and handler in k]


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


def unreachable_webhook_for(system, uid) -> dict:
    """A fail-closed admission webhook that cannot be reached: the API server answers 500 for the
    Jobs of one task only (selected by its uid label), a transient error for as long as it stays."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"unreachable-{system.namespace}"},
        "webhooks": [{
            "name": "unreachable.retex.dev", "clientConfig": {"url": "https://127.0.0.1:9/"},
            "rules": [{"apiGroups": ["batch"], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["jobs"]}],
            "objectSelector": {"matchLabels": {LABEL_TASK_UID: uid}},
            "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 2,
        }],
    }


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


def test_a_task_whose_job_the_api_server_would_refuse_is_refused_at_admission_with_its_message(retex):
    retex.kubectl("apply", "-f", "-", input=task_manifest("big-requests", echo("no"), worker=REQUESTS_ABOVE_LIMITS))
    retex.kubectl("apply", "-f", "-", input=task_manifest("bad-toleration", echo("no"), worker=EXISTS_WITH_A_VALUE))
    retex.kubectl("apply", "-f", "-", input=task_manifest("fine", echo("yes")))
    for name, says in (("big-requests", "must be less than or equal to cpu limit"),
                       ("bad-toleration", "value must be empty when `operator` is 'Exists'")):
        retex.kubectl("wait", "--for=condition=Accepted=False", "--timeout=50s", f"task/{name}")
        accepted = condition(retex, name, "Accepted")
        assert accepted["reason"] == "JobRejected" and says in accepted["message"], accepted
        assert status(retex, name)["phase"] == "Refused"
        assert "Refused" in retex.kubectl("get", "task", name).stdout  # the PHASE column
    succeeded(retex, "fine", timeout=90)
    for name in ("big-requests", "bad-toleration"):
        uid = task(retex, name)["metadata"]["uid"]
        assert jobs_of(retex, uid) == []
        try:
            retex.ledger.get(uid)
            raise AssertionError(f"{name} was admitted into the ledger")
        except TaskNotFound:
            pass
        retex.kubectl("delete", "task", name, "--timeout=30s")


def test_a_refused_task_gets_one_warning_event_per_generation_across_operator_restarts(retex):
    too_big = {"blob": "x" * (64 * 1024)}  # stored by the API server, refused by the model
    retex.kubectl("apply", "-f", "-", input=task_manifest("oversized", echo("no"), payload=too_big))
    wait_for(lambda: condition(retex, "oversized", "Accepted").get("reason") == "InvalidSpec", timeout=60,
             what="refused as InvalidSpec")

    def admissions_in_log():
        return retex.operator.log_tail(10**7).count("Handler 'admit' succeeded")

    for restart in range(2):
        seen = admissions_in_log()
        retex.operator.restart()
        wait_for(lambda: admissions_in_log() > seen, timeout=60,  # noqa: B023 (called in the loop)
                 what=f"resumed after restart {restart + 1}")
    events = json.loads(retex.kubectl("get", "events", "--field-selector",
                                      "involvedObject.name=oversized,reason=InvalidSpec", "-o", "json").stdout)
    assert sum(e.get("count", 1) for e in events["items"]) == 1, [e["message"][:80] for e in events["items"]]
    assert status(retex, "oversized")["phase"] == "Refused"


def test_a_duplicate_idempotency_key_is_refused_naming_the_first_and_its_cancel_ends_without_a_job(retex):
    retex.kubectl("apply", "-f", "-", input=task_manifest(
        "first", [{"name": "wait", "exec": {"command": ["sh", "-c", "sleep 8; echo done"]}}], idempotencyKey="order-7"))
    wait_for(lambda: status(retex, "first").get("phase") == "Running", timeout=60, what="first Running")
    retex.kubectl("apply", "-f", "-", input=task_manifest("second", echo("again"), idempotencyKey="order-7"))
    retex.kubectl("wait", "--for=condition=Accepted=False", "--timeout=50s", "task/second")
    accepted = condition(retex, "second", "Accepted")
    assert accepted["reason"] == "DuplicateIdempotencyKey", accepted
    assert f"{retex.namespace}/first" in accepted["message"] and "order-7" in accepted["message"], accepted
    assert status(retex, "second")["phase"] == "Refused"

    retex.kubectl("patch", "task", "second", "--type=merge", "-p", '{"spec": {"cancel": true}}')
    wait_for(lambda: handled(retex, "second", "cancel", lambda base: base.get("spec", {}).get("cancel") is True),
             timeout=30, what="the cancel of the duplicate handled")
    succeeded(retex, "first", timeout=90)  # not cancelled
    second = task(retex, "second")["metadata"]["uid"]
    assert jobs_of(retex, second) == []
    retex.kubectl("delete", "task", "second", "--timeout=30s")


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


def test_a_task_with_a_non_ascii_payload_applied_with_kubectl_apply_runs_and_can_be_deleted(retex):
    # 32700 × "é" is 65400 bytes of UTF-8, under the 64 KiB payload limit; kopf's default diff base
    # stored it escaped (\u00e9, 6 bytes each) next to kubectl's own last-applied copy: > 256 KiB.
    payload = {"note": "é" * 32700}
    retex.kubectl("apply", "-f", "-", input=task_manifest("accented", echo("ok"), payload=payload))
    succeeded(retex, "accented", timeout=90)
    annotations = task(retex, "accented")["metadata"]["annotations"]
    ours = sum(len(k) + len(v.encode()) for k, v in annotations.items() if k.startswith("kopf.retex.dev/"))
    assert ours < 1024, {k: len(v) for k, v in annotations.items()}
    retex.kubectl("delete", "task", "accented", "--timeout=60s")
    assert task(retex, "accented") is None


def test_a_task_whose_annotations_leave_no_room_for_the_operators_is_refused_and_can_be_deleted(retex):
    manifest = yaml.safe_load(task_manifest("annotated", echo("no")))
    manifest["metadata"]["annotations"] = {"example.com/blob": "a" * (250 * 1024)}
    retex.kubectl("create", "-f", "-", input=json.dumps(manifest))
    retex.kubectl("wait", "--for=condition=Accepted=False", "--timeout=50s", "task/annotated")
    accepted = condition(retex, "annotated", "Accepted")
    assert accepted["reason"] == "AnnotationsTooLarge" and "256016 bytes" in accepted["message"], accepted
    retex.kubectl("delete", "task", "annotated", "--timeout=60s")


def test_a_job_create_failing_transiently_backs_off_that_task_alone_and_it_runs_once_the_api_recovers(retex):
    # A fail-closed admission webhook that cannot be reached: a transient error, not the Task's fault.
    retex.operator.kill()
    busy = admitted_while_the_operator_is_down(retex, "busy", echo("at-last"))
    webhook = unreachable_webhook_for(retex, busy)
    retex.rig.kubectl("apply", "-f", "-", input=json.dumps(webhook))
    try:
        retex.kubectl("create", "-f", "-", input="---\n".join(task_manifest(f"fine-{i}", echo(i)) for i in range(5)))
        retex.operator.start()
        for i in range(5):
            succeeded(retex, f"fine-{i}", timeout=120)

        def deferred_twice():
            with psycopg.connect(retex.operator.dsn) as conn:
                row = conn.execute("SELECT attempts, last_error FROM retex.outbox WHERE task_uid = %s",
                                   (busy,)).fetchone()
            return {"attempts": row[0], "last_error": row[1]} if row and row[0] >= 2 else None

        deferred = wait_for(deferred_twice, timeout=30, what="the busy record deferred twice")
        assert "failed calling webhook" in deferred["last_error"], deferred
        assert jobs_of(retex, busy) == [] and status(retex, "busy").get("phase") == "Running"
    finally:
        retex.rig.kubectl("delete", "validatingwebhookconfiguration", webhook["metadata"]["name"], check=False)
    succeeded(retex, "busy", timeout=120)  # within its backoff
    assert retex.ledger.get(busy).failures == 0  # a transient refusal costs no retry budget


def test_a_job_name_held_by_a_job_not_of_this_task_is_a_refusal_not_success(retex):
    retex.operator.kill()
    uid = admitted_while_the_operator_is_down(retex, "squatted", echo("never"))
    name = job_name("squatted", uid, 1)
    foreign = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
               "spec": {"suspend": True, "template": {"spec": {"restartPolicy": "Never", "containers": [
                   {"name": "c", "image": "busybox", "command": ["true"]}]}}}}
    retex.kubectl("create", "-f", "-", input=json.dumps(foreign))
    retex.operator.start()
    wait_for(lambda: status(retex, "squatted").get("phase") == "Failed", timeout=60, what="squatted Failed")
    failed = condition(retex, "squatted", "Failed")
    assert failed["reason"] == "JobRejected", failed
    assert f'Job "{name}" already exists and is not owned by this Task' in failed["message"], failed
    job = json.loads(retex.kubectl("get", "job", name, "-o", "json").stdout)
    assert not job["metadata"].get("ownerReferences") and job["spec"]["suspend"] is True  # left alone


def admissions_in_log(system) -> int:
    return system.operator.log_tail(10**7).count("Handler 'admit' succeeded")


def restart_and_resume(system, tasks: int) -> None:
    """Restart the operator and wait until kopf's resume handler has run for `tasks` Tasks."""
    seen = admissions_in_log(system)
    system.operator.restart()
    wait_for(lambda: admissions_in_log(system) >= seen + tasks, timeout=60, what=f"{tasks} Tasks resumed")


def refused_and_never_admitted(system, name, reason):
    uid = task(system, name)["metadata"]["uid"]
    assert status(system, name)["phase"] == "Refused" and condition(system, name, "Accepted")["reason"] == reason
    assert jobs_of(system, uid) == []
    try:
        system.ledger.get(uid)
        raise AssertionError(f"{name} was admitted into the ledger")
    except TaskNotFound:
        pass


def test_a_task_refused_as_job_rejected_stays_refused_after_the_cause_is_gone_and_the_operator_restarts(retex):
    # A policy that denies every Job in the namespace: the dry run at admission refuses the Task.
    policy_name = f"no-jobs-{retex.namespace}"
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": policy_name},
              "spec": {"failurePolicy": "Fail",
                       "matchConstraints": {"resourceRules": [{"apiGroups": ["batch"], "apiVersions": ["v1"],
                                                               "operations": ["CREATE"], "resources": ["jobs"]}]},
                       "validations": [{"expression": "false", "message": "no Jobs here today"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": policy_name},
               "spec": {"policyName": policy_name, "validationActions": ["Deny"],
                        "matchResources": {"namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": retex.namespace}}}}}
    probe = json.dumps({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "probe"},
                        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
                            {"name": "c", "image": "busybox", "command": ["true"]}]}}}})

    def jobs_denied() -> bool:
        out = retex.kubectl("create", "--dry-run=server", "-f", "-", input=probe, check=False)
        return out.returncode != 0 and "no Jobs here today" in out.stderr

    retex.rig.kubectl("apply", "-f", "-", input=json.dumps(policy))
    retex.rig.kubectl("apply", "-f", "-", input=json.dumps(binding))
    try:
        wait_for(jobs_denied, timeout=30, what="the policy in force")
        retex.kubectl("apply", "-f", "-", input=task_manifest("denied", echo("no")))
        retex.kubectl("wait", "--for=condition=Accepted=False", "--timeout=50s", "task/denied")
        assert "no Jobs here today" in condition(retex, "denied", "Accepted")["message"]
    finally:
        for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
            retex.rig.kubectl("delete", kind, policy_name, check=False)
    wait_for(lambda: not jobs_denied(), timeout=30, what="the policy gone")
    restart_and_resume(retex, 1)  # admission asked again: its dry run would pass now
    refused_and_never_admitted(retex, "denied", "JobRejected")
    retex.kubectl("delete", "task", "denied", "--timeout=30s")


def test_a_duplicate_stays_refused_after_the_first_is_purged_and_the_purge_frees_no_idempotency_key(retex):
    retex.kubectl("apply", "-f", "-", input=task_manifest("first", echo("once"), idempotencyKey="order-7"))
    succeeded(retex, "first", timeout=90)
    retex.kubectl("apply", "-f", "-", input=task_manifest("second", echo("twice"), idempotencyKey="order-7"))
    retex.kubectl("wait", "--for=condition=Accepted=False", "--timeout=50s", "task/second")
    assert retex.ledger.purge_finished(older_than_seconds=0) == 1
    restart_and_resume(retex, 2)
    refused_and_never_admitted(retex, "second", "DuplicateIdempotencyKey")
    retex.kubectl("apply", "-f", "-", input=task_manifest("third", echo("thrice"), idempotencyKey="order-7"))
    retex.kubectl("wait", "--for=condition=Accepted=False", "--timeout=50s", "task/third")
    refused_and_never_admitted(retex, "third", "DuplicateIdempotencyKey")
    assert f"{retex.namespace}/first" in condition(retex, "third", "Accepted")["message"]


def test_a_dispatch_deferred_past_the_limit_fails_its_task_as_dispatch_failed_with_the_last_error(retex):
    retex.operator.kill()
    stuck = admitted_while_the_operator_is_down(retex, "stuck", echo("never"))
    webhook = unreachable_webhook_for(retex, stuck)
    retex.rig.kubectl("apply", "-f", "-", input=json.dumps(webhook))
    try:
        retex.operator.start(RETEX_DISPATCH_DEFER_LIMIT_SECONDS="5")
        wait_for(lambda: status(retex, "stuck").get("phase") == "Failed", timeout=60, what="stuck Failed")
    finally:
        retex.rig.kubectl("delete", "validatingwebhookconfiguration", webhook["metadata"]["name"], check=False)
    failed = condition(retex, "stuck", "Failed")
    assert failed["status"] == "True" and failed["reason"] == "DispatchFailed", failed
    assert "failed calling webhook" in failed["message"], failed
    assert jobs_of(retex, stuck) == [] and retex.ledger.get(stuck).failures == 0


def test_a_ledger_spec_the_models_refuse_fails_its_task_at_once_without_stopping_the_relay(retex):
    # Garbage in the ledger's copy (written by an older operator, or by hand): the Job is built
    # from the live Task, so the copy is only compared, and it differs: SpecMismatch, at once.
    retex.operator.kill()
    broken = admitted_while_the_operator_is_down(retex, "broken", echo("never"))
    with psycopg.connect(retex.dsn) as conn:
        conn.execute("""UPDATE retex.tasks SET spec = '{"steps": "not a list"}' WHERE uid = %s""", (broken,))
    retex.operator.start()
    wait_for(lambda: status(retex, "broken").get("phase") == "Failed", timeout=30, what="broken Failed")
    failed = condition(retex, "broken", "Failed")
    assert failed["reason"] == "SpecMismatch", failed
    assert jobs_of(retex, broken) == []
    retex.kubectl("apply", "-f", "-", input=task_manifest("after", echo("after")))
    succeeded(retex, "after", timeout=60)  # the relay goes on


def attempt_row(system, uid) -> dict:
    with psycopg.connect(system.dsn) as conn:
        row = conn.execute("SELECT job_name, outcome, settled_at IS NOT NULL FROM retex.attempts "
                           "WHERE task_uid = %s AND epoch = 1", (uid,)).fetchone()
    return {"job_name": row[0], "outcome": row[1], "settled": row[2]}


@pytest.mark.parametrize(("then", "phase", "reason"), [("cancel", "Cancelled", "Cancelled"),
                                                      ("break-spec", "Failed", "SpecMismatch")])
def test_a_job_created_by_a_relay_that_died_before_its_commit_is_deleted_when_the_dispatch_ends_otherwise(
        retex, then, phase, reason):
    # Crash-matrix R3: the relay created the Job and died before marking the record sent; its
    # worker is starting (it waits for the ledger endpoint, the operator being down). The restarted
    # relay does not send the record again: the task was cancelled, or its ledger spec is not the
    # Task's any more. It must not assume that no Job exists: the Job is deleted, and the attempt
    # keeps its slot until its worker is known dead.
    retex.operator.restart(RETEX_FAILPOINT="after-job-create@orphan")
    retex.kubectl("apply", "-f", "-", input=task_manifest(
        "orphan", [{"name": "long", "exec": {"command": ["sh", "-c", "sleep 120"]}}]))
    wait_for(lambda: retex.operator.exited() is not None, timeout=60, what="the relay to die after the Job create")
    uid = task(retex, "orphan")["metadata"]["uid"]
    assert jobs_of(retex, uid), "the Job the relay created before it died"
    if then == "cancel":
        retex.kubectl("patch", "task", "orphan", "--type=merge", "-p", '{"spec": {"cancel": true}}')
    else:
        with psycopg.connect(retex.dsn) as conn:
            conn.execute("""UPDATE retex.tasks SET spec = '{"steps": "not a list"}' WHERE uid = %s""", (uid,))
    retex.operator.start()
    wait_for(lambda: retex.ledger.get(uid).phase == phase, timeout=60, what=f"orphan {phase}")
    assert retex.ledger.get(uid).reason == reason
    wait_for(lambda: jobs_of(retex, uid) == [], timeout=30, what="the orphaned Job deleted")
    assert attempt_row(retex, uid)["job_name"] == job_name("orphan", uid, 1)
    wait_for(lambda: attempt_row(retex, uid)["settled"], timeout=60, what="the attempt settled once its worker is gone")


def test_a_dispatch_of_a_task_deleted_before_its_job_existed_ends_it_as_task_deleted_not_cancelled(retex):
    retex.operator.kill()
    uid = admitted_while_the_operator_is_down(retex, "deleted", echo("never"), finalizer=True)
    retex.kubectl("delete", "task", "deleted", "--wait=false")
    retex.ledger.request_cancel(uid, reason="TaskDeleted")  # what the delete handler records first
    retex.operator.start()
    wait_for(lambda: task(retex, "deleted") is None, timeout=60, what="the deleted Task gone")
    record = retex.ledger.get(uid)
    assert (record.phase, record.reason) == ("Cancelled", "TaskDeleted")
    assert jobs_of(retex, uid) == []


def test_a_requeue_of_a_refused_task_is_ignored_once_and_says_why(retex):
    retex.kubectl("apply", "-f", "-", input=task_manifest("refused", echo("no"), worker=REQUESTS_ABOVE_LIMITS))
    retex.kubectl("wait", "--for=condition=Accepted=False", "--timeout=50s", "task/refused")
    request_requeue(retex.kubectl, "refused", "1")
    wait_for(lambda: handled(retex, "refused", "requeue",
                             lambda base: base.get("metadata", {}).get("annotations", {}).get("retex.dev/requeue") == "1"),
             timeout=30, what="the requeue handled")
    events = json.loads(retex.kubectl("get", "events", "--field-selector",
                                      "involvedObject.name=refused,reason=RequeueIgnored", "-o", "json").stdout)
    assert [e["message"] for e in events["items"]] == [
        "requeue ignored: the Task was refused at admission (JobRejected), it never runs; create a new Task"]
    assert status(retex, "refused")["phase"] == "Refused"


def test_the_final_event_of_a_task_is_posted_even_after_a_burst_of_attempt_events(retex):
    # Eleven attempts, all lost before the mirror ever showed the task: Accepted and the
    # AttemptStarted catch-up fill the per-task Event budget (10 a minute); Failed must still show.
    retex.operator.kill()
    uid = admitted_while_the_operator_is_down(retex, "lost", echo("never"))
    for epoch in range(1, 12):
        retex.ledger.replace_attempt(uid, epoch, cause="disruption")
    assert retex.ledger.get(uid).reason == "DisruptionBudgetExhausted"
    retex.operator.start()

    def events(reason):
        listed = json.loads(retex.kubectl("get", "events", "--field-selector",
                                          f"involvedObject.name=lost,reason={reason}", "-o", "json").stdout)
        return listed["items"]

    wait_for(lambda: status(retex, "lost").get("phase") == "Failed", timeout=60, what="lost shown Failed")
    wait_for(lambda: events("Failed"), timeout=20, what="the Failed Event")
    assert "disruption cap reached" in events("Failed")[0]["message"]
    assert len(events("AttemptStarted")) < 11  # the limiter still holds back the catch-up


def test_a_spec_changed_in_the_ledger_is_never_dispatched_the_task_fails_as_spec_mismatch(retex):
    """The control plane trusts only the Task: whoever could write the ledger's copy of a spec
    (another image, ServiceAccount or command) gets no Job from it."""
    retex.operator.kill()
    uid = admitted_while_the_operator_is_down(retex, "poisoned", [{"name": "only", "exec": {"command": ["echo", "mine"]}}])
    with psycopg.connect(retex.dsn) as conn:
        conn.execute("""UPDATE retex.tasks SET spec = jsonb_set(jsonb_set(spec,
                          '{worker}', '{"image": "evil/steal:1", "serviceAccountName": "default"}'),
                          '{steps,0,exec,command}', '["echo", "stolen"]') WHERE uid = %s""", (uid,))
    retex.operator.start()
    wait_for(lambda: status(retex, "poisoned").get("phase") == "Failed", timeout=60, what="poisoned Failed")
    failed = condition(retex, "poisoned", "Failed")
    assert failed["reason"] == "SpecMismatch", failed
    assert "the ledger's copy of the spec differs from the Task's" in failed["message"], failed
    assert jobs_of(retex, uid) == []  # nothing was built from the ledger's copy


@contextlib.contextmanager
def sleeping_webhook(directory: Path, seconds: float) -> Iterator[dict[str, Any]]:
    """An admission webhook over TLS that allows everything after `seconds`: each call the API
    server makes to it answers that late. Yields its clientConfig."""
    pki = ledger_serving(directory)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.crt("ledger"), pki.key("ledger"))

    class Allow(BaseHTTPRequestHandler):
        def do_POST(self):
            review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(seconds)
            body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                               "response": {"uid": review["request"]["uid"], "allowed": True}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Allow)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {"url": f"https://127.0.0.1:{server.server_address[1]}/", "caBundle": base64.b64encode(
            pki.ca_crt.read_bytes()).decode()}
    finally:
        server.shutdown()


def test_every_dispatch_goes_out_though_each_job_create_outlasts_the_ledgers_idle_limit(retex, tmp_path):
    """The API server answers each Job create 12 s late (a webhook that sleeps), past the 8 s a
    ledger session of the operator may sit idle in a transaction (its renew deadline). A relay
    that held its batch's transaction across the create had it ended by the server every time and
    claimed the same record again: nothing was ever dispatched, and no limit was reached."""
    names = [f"slow-{i}" for i in range(3)]
    with sleeping_webhook(tmp_path / "webhook-tls", seconds=12) as client_config:
        webhook = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": f"sleeping-{retex.namespace}"},
            "webhooks": [{
                "name": "sleeping.retex.dev", "clientConfig": client_config,
                "rules": [{"apiGroups": ["batch"], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["jobs"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": retex.namespace}},
                "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 20,
            }],
        }
        retex.rig.kubectl("apply", "-f", "-", input=json.dumps(webhook))
        try:
            retex.operator.kill()
            # Each call may take D − R = 22 s; a session may sit idle in a transaction R = 8 s.
            retex.operator.start(RETEX_LEADER_LEASE_SECONDS="30", RETEX_LEADER_RENEW_DEADLINE_SECONDS="8",
                                 RETEX_LEADER_RETRY_SECONDS="2")
            began = time.monotonic()
            retex.kubectl("create", "job", "probe", "--image=busybox", "--dry-run=server", "--", "true")
            assert time.monotonic() - began >= 12, "the fault did not fire: a Job create was answered at once"
            retex.kubectl("create", "-f", "-", input="---\n".join(task_manifest(name, echo(name)) for name in names))
            wait_for(lambda: all(status(retex, name).get("phase") == "Succeeded" for name in names), timeout=240,
                     interval=2, what="every task dispatched and Succeeded though each Job create takes 12 s")
        finally:
            retex.rig.kubectl("delete", "validatingwebhookconfiguration", webhook["metadata"]["name"], check=False)
    with psycopg.connect(retex.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM retex.outbox WHERE sent_at IS NULL").fetchone()[0] == 0
