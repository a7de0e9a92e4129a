"""One tenant cannot fill the shared ledger: a Task deleted from Kubernetes keeps its ledger row
until history retention purges it, so a tenant creating and deleting Tasks in a loop reaches its
namespace's quota and its next Task is refused at admission, while another tenant's Task runs."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from e2e.system import discard_namespace, prepare_namespace, task_manifest, wait_for
from retex.kube.objects import LABEL_TASK_UID
from retex.ledger import TaskNotFound
from tests.cluster.conftest import retex_running

QUOTA = 3


def task(system, namespace: str, name: str) -> dict:
    out = system.rig.kubectl("-n", namespace, "get", "task", name, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def create(system, namespace: str, name: str) -> str:
    system.rig.kubectl("-n", namespace, "create", "-f", "-",
                       input=task_manifest(name, [{"name": "say", "exec": {"command": ["sh", "-c", "echo hi"]}}]))
    return task(system, namespace, name)["metadata"]["uid"]


def phase(system, namespace: str, name: str, expected: str, *, timeout: float = 90) -> dict:
    """The Task once its phase is `expected`."""

    def reached():
        body = task(system, namespace, name)
        return body if (body.get("status") or {}).get("phase") == expected else None

    return wait_for(reached, timeout=timeout, what=f"{namespace}/{name} {expected}")


def accepted(body: dict) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == "Accepted")


def test_a_tenant_creating_and_deleting_tasks_in_a_loop_is_refused_at_its_quota_while_another_tenant_runs(
        rig, postgres, tmp_path):
    suffix = uuid.uuid4().hex[:6]
    noisy, quiet, database = f"quota-noisy-{suffix}", f"quota-quiet-{suffix}", f"retex_quota_{suffix}"
    prepare_namespace(rig.kubectl, quiet)
    try:
        with retex_running(rig, postgres.dsn(), postgres.dsn(dbname=database), database, noisy,
                           Path(tmp_path) / "operator.log", RETEX_NAMESPACES=f"{noisy},{quiet}",
                           RETEX_NAMESPACE_MAX_TASKS=str(QUOTA)) as retex:
            for i in range(QUOTA):
                create(retex, noisy, f"loop-{i}")
                phase(retex, noisy, f"loop-{i}", "Succeeded")
                rig.kubectl("-n", noisy, "delete", "task", f"loop-{i}", "--wait=true", "--timeout=60s")
            assert retex.ledger.namespace_usage(noisy).tasks == QUOTA  # every one deleted, every one kept

            refused_uid = create(retex, noisy, "one-more")
            refused = accepted(phase(retex, noisy, "one-more", "Refused"))
            assert (refused["status"], refused["reason"]) == ("False", "QuotaExceeded"), refused
            assert f"namespace {noisy} keeps {QUOTA} tasks in the ledger, at or over its limit of {QUOTA}" \
                in refused["message"], refused
            assert "RETEX_NAMESPACE_MAX_TASKS" in refused["message"] and "7 days after it ended" in refused["message"]
            assert retex.ledger.refusal(refused_uid).reason == "QuotaExceeded"  # stored: final for the Task
            try:
                retex.ledger.get(refused_uid)
                raise AssertionError("the refused Task was admitted into the ledger")
            except TaskNotFound:
                pass
            jobs = rig.kubectl("-n", noisy, "get", "jobs", "-l", f"{LABEL_TASK_UID}={refused_uid}", "-o", "name")
            assert jobs.stdout.split() == []

            create(retex, quiet, "neighbour")
            phase(retex, quiet, "neighbour", "Succeeded")

            # Retention purges the finished tasks and frees the room; the refused Task stays refused
            # (its refusal stands at every admission, kopf's resume included), a new one runs.
            retex.operator.restart(RETEX_HISTORY_RETENTION_DAYS="0.00002")  # about 1.7 s
            wait_for(lambda: retex.ledger.namespace_usage(noisy).tasks == 0, timeout=60, what="the loop's tasks purged")
            create(retex, noisy, "after-the-purge")
            phase(retex, noisy, "after-the-purge", "Succeeded")
            assert (task(retex, noisy, "one-more")["status"]["phase"], retex.ledger.refusal(refused_uid).reason) == \
                ("Refused", "QuotaExceeded")
    finally:
        discard_namespace(rig.kubectl, quiet)
