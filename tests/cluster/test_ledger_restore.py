"""The ledger restored from a backup while Tasks had moved on: the Task is the ledger's witness.
Whatever the restored ledger forgot — a step committed after the backup, a whole Task admitted
after it — is frozen (phase LedgerBehind), never run again from what the ledger holds; a human's
recovery from the status then finishes it without repeating an effect the counting stub saw."""

import json
import subprocess

import psycopg
import pytest

from e2e.system import task_manifest, wait_for
from tests.cluster.gates import gate_step
from tests.cluster.test_cli_as_user import cli
from tests.cluster.test_status_mirror import status, uid_of

pytestmark = pytest.mark.timeout(420)


def charge(notifier) -> dict:
    """Neither idempotent nor verifiable, at a stub that executes every delivery: a second run shows."""
    return {"name": "charge", "http": {"method": "POST", "url": f"{notifier.url}/effects/charge"}, "timeoutSeconds": 30}


def gated(gate, name) -> dict:
    return {**gate_step(gate), "name": name}


def executions(notifier, uid) -> int:
    return notifier.for_task(uid).get("charge", {}).get("executions", 0)


def frozen_reason(system, name) -> str | None:
    shown = status(system, name)
    condition = next((c for c in shown.get("conditions") or [] if c["type"] == "LedgerBehind"), {})
    return condition.get("reason") if shown.get("phase") == "LedgerBehind" and condition.get("status") == "True" else None


def restore(postgres, dsn: str, dump) -> None:
    """The database dropped (its sessions ended) and made again from `dump`, as a restore does."""
    database = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {database} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {database}")
    subprocess.run([str(postgres.bindir / "pg_restore"), "--dbname", dsn, "--no-owner", str(dump)], check=True)


def test_a_ledger_restored_from_a_backup_freezes_what_it_forgot_and_recovery_repeats_no_effect(
        retex, postgres, stubs, gates, tmp_path):
    _, notifier = stubs
    first, second = gates(False), gates(False)
    retex.kubectl("apply", "-f", "-", input=task_manifest("order", [gated(first, "hold"), charge(notifier),
                                                                     gated(second, "wrap")]))
    uid = wait_for(lambda: uid_of(retex, "order") or None, timeout=30, what="the Task's uid")
    wait_for(lambda: first.last_asked() is not None, timeout=90, what="order's worker at its first gate")

    dump = tmp_path / "ledger.dump"  # the backup: order at its first step, charge not begun
    subprocess.run([str(postgres.bindir / "pg_dump"), "--dbname", retex.dsn, "--format=custom", "--file", str(dump)],
                   check=True)
    assert retex.ledger.get(uid).steps[1].state == "pending"

    first.open()  # after the backup: charge runs once and commits; order waits at its second gate
    wait_for(lambda: [s["state"] for s in status(retex, "order").get("steps", [])] == ["done", "done", "started"],
             timeout=60, what="order shown with charge done and its last step started")
    retex.kubectl("apply", "-f", "-",  # admitted after the backup
                  input=task_manifest("later", [charge(notifier)], idempotencyKey="later-7"))
    wait_for(lambda: status(retex, "later").get("phase") == "Succeeded", timeout=90, what="later Succeeded")
    later = uid_of(retex, "later")
    assert (executions(notifier, uid), executions(notifier, later)) == (1, 1)
    shown = status(retex, "order")["ledgerVersion"]

    retex.operator.kill()
    restore(postgres, retex.dsn, dump)
    with psycopg.connect(retex.dsn) as conn:  # the fault fired: the ledger forgot charge and all of `later`
        held = conn.execute("SELECT version FROM retex.tasks WHERE uid = %s", (uid,)).fetchone()[0]
        assert held < shown
        assert conn.execute("SELECT count(*) FROM retex.tasks WHERE uid = %s", (later,)).fetchone()[0] == 0
    # While the operator is away, a client resubmits `later`'s work under its idempotencyKey: the
    # restored ledger knows the key from no task, and this one must not take it and run again.
    retex.kubectl("apply", "-f", "-", input=task_manifest("again", [charge(notifier)], idempotencyKey="later-7"))
    retex.operator.start()

    wait_for(lambda: frozen_reason(retex, "order") == "LedgerBehind", timeout=60, what="order frozen LedgerBehind")
    wait_for(lambda: frozen_reason(retex, "later") == "LedgerLost", timeout=60, what="later frozen LedgerLost")
    assert status(retex, "later")["steps"][0]["state"] == "done", "a frozen task shows what its Task showed"
    wait_for(lambda: status(retex, "again").get("phase") == "Refused", timeout=60, what="the resubmission refused")
    refused = next(c for c in status(retex, "again")["conditions"] if c["type"] == "Accepted")
    assert refused["reason"] == "DuplicateIdempotencyKey" and later in refused["message"]
    assert retex.operator.metrics()[("retex_frozen_tasks", ())] == 2
    events = json.loads(retex.kubectl("get", "events", "--field-selector", "reason=LedgerBehind", "-o", "json").stdout)
    assert {e["involvedObject"]["name"] for e in events["items"]} == {"order", "later"}

    second.open()  # order's worker of before reaches its last commit: fenced, the task is frozen
    wait_for(lambda: not [p for p in json.loads(retex.kubectl("get", "pods", "-l", f"retex.dev/task-uid={uid}",
                                                                "-o", "json").stdout)["items"]
                          if p["status"].get("phase") in ("Pending", "Running")],
             timeout=90, what="order's worker of before gone")
    assert frozen_reason(retex, "order") == "LedgerBehind" and executions(notifier, uid) == 1

    for name in ("order", "later"):  # the human action
        answer = cli(retex.rig.kubeconfig, "recover", name, "-n", retex.namespace, "--from-status")
        assert answer.returncode == 0, answer.stderr
    wait_for(lambda: status(retex, "order").get("phase") == "Succeeded", timeout=120, what="order recovered, Succeeded")
    wait_for(lambda: status(retex, "later").get("phase") == "Succeeded", timeout=60, what="later recovered, Succeeded")
    assert (executions(notifier, uid), executions(notifier, later)) == (1, 1), "no effect twice"
    assert executions(notifier, uid_of(retex, "again")) == 0
    assert retex.ledger.get(uid).epoch >= 2, "order ran its last step in a new attempt"
    assert retex.ledger.attempts(later) == [], "later, shown Succeeded, was not run again"
    history = retex.ledger.history(uid)
    assert [h.event for h in history if h.event in ("freeze", "recover")] == ["freeze", "recover"]
    wait_for(lambda: retex.operator.metrics()[("retex_frozen_tasks", ())] == 0, timeout=30,
             what="no task frozen (the scrape's figures are cached a few seconds)")
