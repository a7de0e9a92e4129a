"""The status mirror against the rig's real API server: a Task whose status write the API server
keeps refusing, not as stale (a ValidatingAdmissionPolicy answering 403, as after a tenant's
RoleBinding is removed, or 422, as a CEL rule other than the ledgerVersion one), holds up no other
Task's status, is logged with the API server's words, and is written once the refusal is gone. A
ledger that forgot commits a Task's status showed is announced (log line, Event, metric)."""

from __future__ import annotations

import json

import psycopg
import pytest

from e2e.system import task_manifest, wait_for
from tests.cluster.test_policies import events_of

# Several refused Tasks: in the one-round mirror whichever came first in its pending set failed the
# round, so the fine Task's mark was written only if it happened to come before all of them.
REFUSED = tuple(f"refused-{n}" for n in range(5))
REFUSAL = "no status for you"


def status(system, name) -> dict:
    out = system.kubectl("get", "task", name, "-o", "json", check=False)
    return (json.loads(out.stdout).get("status") or {}) if out.returncode == 0 else {}


def uid_of(system, name) -> str:
    return system.kubectl("get", "task", name, "-o", "jsonpath={.metadata.uid}").stdout


def echo(word):
    return [{"name": "say", "exec": {"command": ["sh", "-c", f"echo {word}"]}}]


def failed_writes(system) -> list[dict]:
    """The operator's "status write failed; retrying" lines."""
    lines = (json.loads(line) for line in system.operator.log_tail(10**8).splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("msg") == "status write failed; retrying"]


def policy_refusing_status_writes(namespace: str, reason: str) -> tuple[dict, dict]:
    """A policy refusing every status write to a Task named refused-*, answering with `reason`."""
    name = f"no-status-{namespace}"
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": name},
              "spec": {"failurePolicy": "Fail",
                       "matchConstraints": {"resourceRules": [{"apiGroups": ["retex.dev"], "apiVersions": ["*"],
                                                               "operations": ["UPDATE"],
                                                               "resources": ["tasks/status"]}]},
                       "validations": [{"expression": "!object.metadata.name.startsWith('refused-')",
                                        "reason": reason, "message": REFUSAL}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": name},
               "spec": {"policyName": name, "validationActions": ["Deny"],
                        "matchResources": {"namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": namespace}}}}}
    return policy, binding


@pytest.mark.parametrize("reason, http_status", [("Forbidden", 403), ("Invalid", 422)])
def test_a_task_whose_status_write_is_refused_holds_up_no_other_tasks_status_and_is_written_once_allowed(
        retex, reason, http_status):
    policy, binding = policy_refusing_status_writes(retex.namespace, reason)

    def status_refused() -> tuple[bool, str]:
        out = retex.kubectl("patch", "task", REFUSED[0], "--subresource=status", "--type=merge", "--dry-run=server",
                            "-p", json.dumps({"status": {"lastError": "probe"}}), check=False)
        return out.returncode != 0 and REFUSAL in out.stderr, (out.stdout + out.stderr)[-300:]

    # The refused Tasks are created while no operator runs, and it starts only once the policy is
    # in force: none of their statuses can land before it.
    retex.operator.stop()
    retex.rig.kubectl("apply", "-f", "-", input=json.dumps(policy))
    retex.rig.kubectl("apply", "-f", "-", input=json.dumps(binding))
    try:
        for name in REFUSED:
            retex.kubectl("apply", "-f", "-", input=task_manifest(name, echo("held")))
        wait_for(status_refused, timeout=30, what="the policy in force")
        retex.operator.start()
        refused_uids = {uid_of(retex, name) for name in REFUSED}
        # The fault fired: each refused Task's write was refused with the policy's words, and retried.
        wait_for(lambda: {line["uid"] for line in failed_writes(retex)
                          if line.get("http_status") == http_status and REFUSAL in line.get("message", "")} == refused_uids,
                 timeout=60, what="every refused Task's status write refused, as retried")
        retex.kubectl("apply", "-f", "-", input=task_manifest("fine", echo("shown")))
        wait_for(lambda: status(retex, "fine").get("phase") == "Succeeded", timeout=60, what="fine shown Succeeded")
        wait_for(lambda: all(retex.ledger.get(uid).phase == "Succeeded" for uid in refused_uids), timeout=90,
                 what="the refused Tasks run to the end: only their status is held")
        assert all(status(retex, name).get("ledgerVersion") is None for name in REFUSED), "still refused"
        assert {line["level"] for line in failed_writes(retex) if REFUSAL in line["message"]} == {"error"}, (
            "a refusal that lasts until someone acts is an error")
    finally:
        for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
            retex.rig.kubectl("delete", kind, policy["metadata"]["name"], check=False)
    wait_for(lambda: not status_refused()[0], timeout=30, what="the policy gone")
    # Each refused Task waits out what is left of its backoff (at most 60 s), then its status is written.
    wait_for(lambda: all(status(retex, name).get("phase") == "Succeeded" for name in REFUSED), timeout=75,
             what="the refused Tasks shown Succeeded once allowed")


def test_a_ledger_that_forgot_commits_a_tasks_status_showed_freezes_the_task_and_says_so(retex):
    retex.kubectl("apply", "-f", "-", input=task_manifest("remembered", echo("done")))
    wait_for(lambda: status(retex, "remembered").get("phase") == "Succeeded", timeout=60, what="remembered Succeeded")
    uid, shown = uid_of(retex, "remembered"), status(retex, "remembered")["ledgerVersion"]
    # The fault: the ledger forgets its last commits of the task (a failover to an asynchronous
    # replica; a restore from an older backup looks the same), while the operator runs.
    with psycopg.connect(retex.dsn, autocommit=True) as conn:
        conn.execute("UPDATE retex.tasks SET version = %s WHERE uid = %s", (shown - 2, uid))
    assert retex.ledger.get(uid).version == shown - 2

    announced = wait_for(lambda: events_of(retex, "remembered", "LedgerBehind"), timeout=30,
                         what="a LedgerBehind Event (the resync runs every 5 s here)")
    assert announced[0]["type"] == "Warning" and "holds an older version of this task" in announced[0]["message"]
    frozen = status(retex, "remembered")
    assert frozen["phase"] == "LedgerBehind" and frozen["ledgerVersion"] == shown + 1
    assert [s["state"] for s in frozen["steps"]] == ["done"], "what it showed, kept"
    assert retex.ledger.get(uid).frozen_reason == "LedgerBehind"
    wait_for(lambda: retex.operator.metrics()[("retex_frozen_tasks", ())] == 1, timeout=30, what="counted frozen")
    lines = [json.loads(line) for line in retex.operator.log_tail(10**8).splitlines() if line.startswith("{")]
    said = [line for line in lines if line.get("msg") == "task frozen: the ledger is behind the Task's status"]
    assert [(line["uid"], line["shown_version"], line["ledger_version"], line["level"]) for line in said] == [
        (uid, shown, shown - 2, "error")], "said once, however many resyncs ran"

    retex.ledger.recover(uid, from_status=True, actor="test")
    wait_for(lambda: status(retex, "remembered").get("phase") == "Succeeded", timeout=30, what="recovered, Succeeded")
    wait_for(lambda: retex.operator.metrics()[("retex_frozen_tasks", ())] == 0, timeout=30, what="the count cleared")
