"""A namespace's quota of what it keeps in the shared ledger: tasks not yet purged, whatever their
phase, and the bytes of their steps' results. Judged at admission only, on one usage row per
namespace that the writes keep (insert, step result, purge), locked so that two admissions never
both take the last place."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from psycopg.types.json import Jsonb

from retex.ledger import Ledger, NamespaceQuota, NamespaceUsage, QuotaUse, Refusal, TaskNotFound
from retex.ledger import migrate as migrations
from tests.integration.ledger_helpers import admission

ROOMY = 10**9


def finished(ledger: Ledger, uid: str, result=None) -> None:
    """Run the task's one attempt to Succeeded, each step committing `result` (or its own)."""
    for step in ledger.get(uid).steps:
        ledger.begin_step(uid, 1, step.idx, actor="worker")
        ledger.commit_step(uid, 1, step.idx, result if result is not None else {"step": step.name}, actor="worker")
    ledger.complete_task(uid, 1, actor="worker")


def test_a_namespace_at_its_task_quota_is_refused_with_what_it_uses_and_another_namespace_is_still_admitted(ledger):
    quota = NamespaceQuota(max_tasks=3, max_result_bytes=ROOMY)
    for _ in range(3):
        assert ledger.admit(admission(namespace="shop"), quota=quota).created
    refused = admission(namespace="shop")
    verdict = ledger.admit(refused, quota=quota)
    assert not verdict.created
    assert verdict.over_quota == QuotaUse(namespace="shop", resource="tasks", used=3, limit=3)
    with pytest.raises(TaskNotFound):
        ledger.get(refused.uid)  # nothing of it written
    assert ledger.namespace_usage("shop") == NamespaceUsage(tasks=3, result_bytes=0)
    assert ledger.admit(admission(namespace="other"), quota=quota).created


def test_a_task_deleted_or_finished_keeps_its_place_until_the_purge_frees_it(ledger):
    quota = NamespaceQuota(max_tasks=2, max_result_bytes=ROOMY)
    done = ledger.admit(admission(steps=("only",), namespace="shop"), quota=quota).uid
    finished(ledger, done)
    deleted = ledger.admit(admission(steps=("only",), namespace="shop"), quota=quota).uid
    ledger.request_cancel(deleted, reason="TaskDeleted")  # its Task deleted: the row stays
    ledger.cancel_unheld(deleted, 1)
    assert ledger.get(deleted).terminal
    late = admission(namespace="shop")
    assert ledger.admit(late, quota=quota).over_quota == QuotaUse(namespace="shop", resource="tasks", used=2, limit=2)
    # The operator stores the refusal: final for the uid, whatever room there is later.
    ledger.refuse(Refusal(uid=late.uid, namespace="shop", name=late.name, reason="QuotaExceeded", message="full",
                          generation=1))

    assert ledger.purge_finished(older_than_seconds=0) == 2
    assert ledger.namespace_usage("shop") == NamespaceUsage(tasks=0, result_bytes=0)
    assert ledger.admit(admission(namespace="shop"), quota=quota).created
    again = ledger.admit(late, quota=quota)
    assert not again.created and again.refusal is not None and again.refusal.reason == "QuotaExceeded"


def test_concurrent_admissions_in_one_namespace_never_pass_its_quota(ledger, dsn):
    quota = NamespaceQuota(max_tasks=7, max_result_bytes=ROOMY)
    admissions = [admission(steps=("only",), namespace="burst") for _ in range(40)]
    start = threading.Barrier(8)
    with Ledger(dsn, retry_for_seconds=30, max_connections=8) as racing:

        def admit_all(part):
            start.wait()
            return [racing.admit(task, quota=quota) for task in part]

        with ThreadPoolExecutor(8) as pool:
            verdicts = [v for f in [pool.submit(admit_all, admissions[i::8]) for i in range(8)] for v in f.result()]
    assert sum(v.created for v in verdicts) == 7
    assert all(v.over_quota is not None for v in verdicts if not v.created)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT count(*) FROM retex.tasks WHERE namespace = 'burst'").fetchone()[0]
    assert rows == 7 and ledger.namespace_usage("burst") == NamespaceUsage(tasks=7, result_bytes=0)


def test_result_bytes_are_counted_at_each_commit_never_stop_a_running_task_and_are_released_by_the_purge(ledger, dsn):
    quota = NamespaceQuota(max_tasks=100, max_result_bytes=200)
    big = {"blob": "x" * 150}  # 162 bytes as the ledger stores it
    first = ledger.admit(admission(steps=("a", "b"), namespace="shop"), quota=quota).uid
    running = ledger.admit(admission(steps=("a",), namespace="shop"), quota=quota).uid
    finished(ledger, first, big)
    with psycopg.connect(dsn) as conn:
        stored = conn.execute("SELECT sum(octet_length(result::text)) FROM retex.steps WHERE task_uid = %s",
                              (first,)).fetchone()[0]
    assert stored == 324 and ledger.namespace_usage("shop") == NamespaceUsage(tasks=2, result_bytes=324)

    ledger.begin_step(running, 1, 0, actor="worker")
    ledger.commit_step(running, 1, 0, big, actor="worker")  # over its quota already: a running task goes on
    assert ledger.namespace_usage("shop").result_bytes == 486
    refused = ledger.admit(admission(namespace="shop"), quota=quota)
    assert refused.over_quota == QuotaUse(namespace="shop", resource="resultBytes", used=486, limit=200)
    assert ledger.admit(admission(namespace="other"), quota=quota).created

    ledger.complete_task(running, 1, actor="worker")
    assert ledger.purge_finished(older_than_seconds=0) == 2
    assert ledger.namespace_usage("shop") == NamespaceUsage(tasks=0, result_bytes=0)
    assert ledger.admit(admission(namespace="shop"), quota=quota).created


def test_a_result_set_by_a_human_counts_and_a_step_without_a_result_counts_nothing(ledger):
    uid = ledger.admit(admission(steps=("charge", "ship"), namespace="shop")).uid
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.commit_step(uid, 1, 0, None, actor="worker")
    assert ledger.namespace_usage("shop").result_bytes == 0
    ledger.begin_step(uid, 1, 1, actor="worker")
    ledger.flag_step(uid, 1, 1, "ambiguous", actor="worker")
    ledger.resolve_step(uid, "ship", mark_done=True, result={"tracking": "Z1"}, actor="cli:ops")
    assert ledger.namespace_usage("shop").result_bytes == len('{"tracking": "Z1"}')


def test_a_task_the_ledger_lost_is_taken_back_past_the_quota_and_counted(ledger):
    quota = NamespaceQuota(max_tasks=1, max_result_bytes=ROOMY)
    assert ledger.admit(admission(namespace="shop"), quota=quota).created
    lost = ledger.admit_lost(admission(namespace="shop"), witness={"phase": "Running"}, shown_version=5)
    assert lost.frozen_reason == "LedgerLost"
    assert ledger.namespace_usage("shop") == NamespaceUsage(tasks=2, result_bytes=0)


def test_the_migration_counts_what_a_ledger_already_holds(dsn, monkeypatch):
    """The upgrade path: a ledger with tasks (finished, running, with and without results) before
    the usage table existed gets each namespace's usage from its rows."""
    every = migrations.available()
    before = [m for m in every if m[1] < "0012"]
    monkeypatch.setattr(migrations, "available", lambda: before)
    with psycopg.connect(dsn) as conn:
        migrations.migrate(conn)
    with psycopg.connect(dsn) as conn:
        for uid, namespace, results in [("a1", "shop", [{"n": 1}, "done"]), ("a2", "shop", [None, None]),
                                        ("b1", "billing", [[1, 2, 3]]), ("c1", "quiet", [])]:
            conn.execute("""INSERT INTO retex.tasks (uid, namespace, name, spec, spec_hash, phase, max_attempts,
                                                     max_disruptions, backoff)
                            VALUES (%s, %s, %s, '{}', 'h', 'Running', 3, 10, '{}')""", (uid, namespace, uid))
            for idx, result in enumerate(results):
                conn.execute("""INSERT INTO retex.steps (task_uid, idx, name, idempotency_key, result)
                                VALUES (%s, %s, %s, %s, %s)""",
                             (uid, idx, f"s{idx}", f"{uid}:{idx}", None if result is None else Jsonb(result)))
    monkeypatch.setattr(migrations, "available", lambda: every)
    with Ledger(dsn, retry_for_seconds=30) as ledger:
        assert ledger.namespace_usage("shop") == NamespaceUsage(tasks=2, result_bytes=len('{"n": 1}') + len('"done"'))
        assert ledger.namespace_usage("billing") == NamespaceUsage(tasks=1, result_bytes=len("[1, 2, 3]"))
        assert ledger.namespace_usage("quiet") == NamespaceUsage(tasks=1, result_bytes=0)
        assert ledger.namespace_usage("nobody") == NamespaceUsage(tasks=0, result_bytes=0)
        quota = NamespaceQuota(max_tasks=3, max_result_bytes=ROOMY)
        assert ledger.admit(admission(namespace="shop"), quota=quota).created
        assert ledger.admit(admission(namespace="shop"), quota=quota).over_quota.used == 3
