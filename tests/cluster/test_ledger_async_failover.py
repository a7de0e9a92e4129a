"""The ledger fails over to an asynchronous standby that never received its last commits: a
Patroni cluster with `synchronous_mode: false` (e2e/patroni.py), its standby cut off from the
primary's WAL while a task's non-idempotent step commits, then the primary lost (kill -9 of its
Patroni and of its postmaster) and the lagging standby promoted once the leader key lapses.

First the fault is proved to have fired: the standby held the task below the version its status
showed, without the step done; the old postmaster died without a clean shutdown; the standby
leads and left recovery. Then: the operator, running throughout, freezes the task through its
status (the ledger's witness) rather than run the forgotten step again; the worker's last commit
is fenced; `retex recover --from-status` finishes the task, and the notifier, which does not
deduplicate, saw the step once.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from e2e.patroni import PatroniCluster
from e2e.system import task_manifest, wait_for
from tests.cluster.conftest import patroni_cluster, retex_on_patroni
from tests.cluster.test_cli_as_user import cli
from tests.cluster.test_ledger_failover import promoted
from tests.cluster.test_ledger_restore import charge, executions, frozen_reason, gated
from tests.cluster.test_status_mirror import status, uid_of

DATABASE = "retex_async_failover"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def async_patroni(rig):
    # Any lag may be promoted: Patroni's own guard (1 MiB by default) would otherwise restart the
    # old primary and lose nothing, which is not the fault under test.
    with patroni_cluster(rig, synchronous=False, maximum_lag_on_failover=2**40) as cluster:
        yield cluster


@pytest.fixture
def replicated(rig, async_patroni, tmp_path):
    with retex_on_patroni(rig, async_patroni, DATABASE, "tenant-async-failover", Path(tmp_path) / "operator.log") as system:
        yield system


def replayed_all(patroni: PatroniCluster, standby: str, leader: str) -> bool:
    """The standby has replayed the leader's WAL as far as the leader has written it."""
    with psycopg.connect(patroni.member(leader).dsn(), autocommit=True) as conn:
        written = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
    with psycopg.connect(patroni.member(standby).dsn(), autocommit=True) as conn:
        row = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (written,)).fetchone()
    return bool(row and row[0])


def replayed_received(patroni: PatroniCluster, standby: str) -> bool:
    with psycopg.connect(patroni.member(standby).dsn(), autocommit=True) as conn:
        row = conn.execute("SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn()").fetchone()
    return bool(row and row[0])


def held_on(patroni: PatroniCluster, member: str, uid: str) -> tuple[int, list[str]]:
    """The task's version and its steps' states in that member's copy of the ledger."""
    with psycopg.connect(patroni.member(member).dsn(dbname=DATABASE), autocommit=True) as conn:
        version = conn.execute("SELECT version FROM retex.tasks WHERE uid = %s", (uid,)).fetchone()[0]
        states = [s for (s,) in conn.execute("SELECT state FROM retex.steps WHERE task_uid = %s ORDER BY idx", (uid,))]
    return version, states


def test_a_standby_promoted_without_the_last_commits_freezes_the_task_and_recovery_repeats_no_effect(
        replicated, async_patroni, stubs, gates):
    system, patroni = replicated, async_patroni
    _, notifier = stubs
    system.operator.wait_leading()
    first, second = gates(False), gates(False)
    system.kubectl("apply", "-f", "-", input=task_manifest("order", [gated(first, "hold"), charge(notifier),
                                                                     gated(second, "wrap")]))
    uid = wait_for(lambda: uid_of(system, "order") or None, timeout=30, what="the Task's uid")
    wait_for(lambda: first.last_asked() is not None, timeout=90, what="order's worker at its first gate")

    primary, standby = patroni.leader(), patroni.standby()
    assert primary and standby and patroni.roles()[standby][0] == "replica", f"not asynchronous: {patroni.roles()}"
    wait_for(lambda: replayed_all(patroni, standby, primary), timeout=30, what=f"{standby} caught up")
    received = patroni.cut_replication()  # from here the standby receives nothing

    first.open()  # charge runs once and commits on the primary alone; order waits at its second gate
    wait_for(lambda: [s["state"] for s in status(system, "order").get("steps", [])] == ["done", "done", "started"],
             timeout=60, what="order shown with charge done and its last step started")
    shown = status(system, "order")["ledgerVersion"]
    assert executions(notifier, uid) == 1

    # The fault, part one: the standby holds the task below the version shown, charge not done.
    wait_for(lambda: replayed_received(patroni, standby), timeout=10, what=f"{standby} replayed what it received")
    held, states = held_on(patroni, standby, uid)
    assert held < shown and states[1] != "done", (held, shown, states)
    with psycopg.connect(patroni.member(primary).dsn(), autocommit=True) as conn:
        assert conn.execute("SELECT pg_current_wal_lsn() > %s::pg_lsn", (received,)).fetchone()[0]

    # Part two: the primary lost. Its Patroni first, so that nothing restarts its Postgres or hands
    # the leadership over in order; the standby takes the leader key once it lapses (deleted rather
    # than waited for: its ttl is at least 20 s).
    patroni.kill_patroni(primary)
    kill = patroni.kill_primary()
    assert kill.member == primary and kill.pid_file_left, "the postmaster shut down cleanly: it was not killed"
    patroni.expire_leader_key()
    wait_for(lambda: patroni.leader() == standby, timeout=60, what=f"{standby} leading after the kill")
    promoted(patroni, standby)
    print(f"{standby} promoted holding order at version {held}; its status showed {shown}", flush=True)

    # The outcome: frozen through the witness, its step not run again.
    wait_for(lambda: frozen_reason(system, "order") == "LedgerBehind", timeout=60, what="order frozen LedgerBehind")
    assert [s["state"] for s in status(system, "order")["steps"]] == ["done", "done", "started"], "what it showed, kept"
    freezes = [h.detail for h in system.ledger.history(uid) if h.event == "freeze"]
    assert len(freezes) == 1 and freezes[0]["shownVersion"] == shown and freezes[0]["ledgerVersion"] < shown, freezes
    assert executions(notifier, uid) == 1

    second.open()  # the worker of before reaches its last commit: fenced, the task stays frozen
    wait_for(lambda: not [p for p in json.loads(system.kubectl("get", "pods", "-l", f"retex.dev/task-uid={uid}",
                                                                 "-o", "json").stdout)["items"]
                          if p["status"].get("phase") in ("Pending", "Running")],
             timeout=90, what="order's worker of before gone")
    assert frozen_reason(system, "order") == "LedgerBehind" and executions(notifier, uid) == 1

    answer = cli(system.rig.kubeconfig, "recover", "order", "-n", system.namespace, "--from-status")
    assert answer.returncode == 0, answer.stderr
    wait_for(lambda: status(system, "order").get("phase") == "Succeeded", timeout=120, what="order recovered, Succeeded")
    assert executions(notifier, uid) == 1, "charge executed again"
    record = system.ledger.get(uid)
    assert record.epoch >= 2, "order ran its last step in a new attempt"
    assert [h.event for h in system.ledger.history(uid) if h.event in ("freeze", "recover")] == ["freeze", "recover"]
    assert system.operator.exited() is None, f"the operator exited ({system.operator.exited()})"
