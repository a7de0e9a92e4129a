"""The ledger replicated by Patroni (e2e/patroni.py: a primary and a synchronous standby on the
rig's etcd) fails over twice while 50 tasks run: a `patronictl switchover`, then a kill -9 of the
new primary's postmaster. The operator's DSN lists both members with
target_session_attrs=read-write, so each reconnection reaches whichever one is primary.

First each fault is proved to have fired (the Patroni leader changed, the standby's
pg_is_in_recovery() flipped to false, the killed postmaster is gone without a clean shutdown);
then: every task ended Succeeded, or NeedsAttention only at its step that is neither idempotent nor
verifiable; no effect executed twice at the notifier (which does not deduplicate); every step the
ledger held done, and the standby had on disk, before the kill is still done after it; no task was
frozen by the ledger's witness; and the operator process lived through both.
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from e2e.patroni import PatroniCluster
from e2e.system import wait_for
from retex.ledger import Ledger, StepRecord, TaskNotFound
from retex.machine import StepState
from tests.cluster.conftest import patroni_cluster, retex_on_patroni
from tests.cluster.test_chaos import print_ledger_state
from tests.cluster.test_crash_matrix import LEASE, STEP_TIMEOUT, effects_of, submit
from tests.cluster.test_operator import status

TASKS = 50
SETTLE_SECONDS = 420
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def patroni(rig):
    with patroni_cluster(rig) as cluster:
        yield cluster


@pytest.fixture
def replicated(rig, patroni, tmp_path):
    with retex_on_patroni(rig, patroni, "retex_failover", "tenant-failover", Path(tmp_path) / "operator.log") as system:
        yield system


def failover_steps(payments, notifier) -> list[dict]:
    steps = [
        {"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge"}, "idempotent": True},
        # neither idempotent nor verifiable: exactly one execution, or (interrupted) NeedsAttention
        {"name": "notify", "http": {"method": "POST", "url": f"{notifier.url}/effects/notify"}},
        # long enough that each fault meets several tasks inside a step
        {"name": "pack", "exec": {"command": ["sh", "-c", "sleep 8; echo packed"]}, "idempotent": True},
    ]
    for step in steps:
        step["timeoutSeconds"] = STEP_TIMEOUT
    steps[-1]["timeoutSeconds"] = 15
    return steps


def steps_of(ledger: Ledger, uid: str) -> tuple[StepRecord, ...]:
    """Its steps in the ledger; none while it is not admitted yet."""
    try:
        return ledger.get(uid).steps
    except TaskNotFound:
        return ()


def done_steps(ledger: Ledger, uids: list[str]) -> dict[str, set[int]]:
    return {uid: {s.idx for s in steps_of(ledger, uid) if s.state == StepState.DONE} for uid in uids}


def in_flight(ledger: Ledger, uids: list[str]) -> int:
    """Tasks that have begun a step and not finished: what a fault now meets."""
    return sum(1 for uid in uids if any(s.state == StepState.STARTED for s in steps_of(ledger, uid)))


def promoted(patroni: PatroniCluster, member: str) -> None:
    """Until the member's pg_is_in_recovery() is false: Patroni takes the leader key before the
    promotion completes."""
    wait_for(lambda: not patroni.member(member).in_recovery(), timeout=30, what=f"{member} out of recovery")


def on_standby_disk(patroni: PatroniCluster, leader: str, lsn: str) -> bool:
    """The synchronous standby has flushed the leader's WAL up to `lsn`."""
    with psycopg.connect(patroni.member(leader).dsn(), autocommit=True) as conn:
        row = conn.execute("SELECT bool_and(flush_lsn >= %s::pg_lsn) FROM pg_stat_replication WHERE sync_state = 'sync'",
                           (lsn,)).fetchone()
    return bool(row and row[0])


def test_tasks_ride_through_a_switchover_and_a_failover_losing_nothing_and_repeating_nothing(
        replicated, patroni, stubs):
    system = replicated
    payments, notifier = stubs
    system.operator.wait_leading()
    started = time.monotonic()
    submitted = {}
    uids: list[str] = []
    done_before_kill: dict[str, set[int]] = {}

    def switchover() -> None:
        """Fault 1: a switchover to the synchronous standby."""
        first, candidate = patroni.leader(), patroni.sync_standby()
        assert first and candidate and patroni.member(candidate).in_recovery()
        flying = in_flight(system.ledger, uids)
        assert flying > 0, "the switchover would meet no task inside a step"
        assert patroni.switchover() == candidate
        print(f"t={time.monotonic() - started:.0f}s switchover {first} -> {candidate} with {flying} tasks "
              "in a step", flush=True)
        assert patroni.leader() == candidate != first
        promoted(patroni, candidate)

    def kill_primary() -> None:
        """Fault 2: kill -9 of the (new) primary's postmaster, its synchronous standby streaming."""
        wait_for(patroni.healthy, timeout=120, what="a synchronous standby streaming again")
        leader, standby = patroni.leader(), patroni.sync_standby()
        assert leader and standby and patroni.member(standby).in_recovery()
        with psycopg.connect(patroni.member(leader).dsn(), autocommit=True) as conn:
            lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
        done_before_kill.update(done_steps(system.ledger, uids))
        # Acknowledged: what that read saw is on the synchronous standby's disk (a commit is seen
        # on the primary a moment before its acknowledgement).
        wait_for(lambda: on_standby_disk(patroni, leader, lsn), timeout=30, what=f"the standby flushed to {lsn}")
        flying = in_flight(system.ledger, uids)
        assert flying > 0, "the kill would meet no task inside a step"
        kill = patroni.kill_primary()
        print(f"t={time.monotonic() - started:.0f}s killed {kill.member}'s postmaster {kill.pid} with "
              f"{sum(len(d) for d in done_before_kill.values())} steps done, {flying} tasks in a step", flush=True)
        assert kill.member == leader
        assert kill.pid_file_left, "the postmaster shut down cleanly: it was not killed"
        wait_for(lambda: patroni.leader() == standby, timeout=60, what=f"{standby} leading after the kill")
        promoted(patroni, standby)

    # Submissions go on through both faults, so each meets tasks at every stage.
    faults = {20: switchover, 40: kill_primary}  # after the 20th submission, after the 40th
    for i in range(1, TASKS + 1):
        name = f"failover-{i}"
        submitted[name] = submit(system, name, failover_steps(payments, notifier), lease=LEASE)
        uids.append(submitted[name].uid)
        if i in faults:
            faults[i]()

    # Every task ends; the operator lived through both faults.
    for name, task in submitted.items():
        try:
            wait_for(lambda n=name: status(system, n).get("phase") in ("Succeeded", "Failed", "NeedsAttention"),
                     timeout=max(started + SETTLE_SECONDS - time.monotonic(), 1), what=f"{name} terminal")
        except Exception:
            print_ledger_state(system, name, task.uid)
            raise
    assert system.operator.exited() is None, f"the operator exited ({system.operator.exited()})"

    after = done_steps(system.ledger, uids)
    assert done_before_kill, "the kill never happened"
    lost = {uid: sorted(d - after[uid]) for uid, d in done_before_kill.items() if d - after[uid]}
    assert not lost, f"steps done before the failover and not after it: {lost}"
    phases: dict[str, int] = {}
    for name, task in submitted.items():
        record = system.ledger.get(task.uid)
        phases[str(record.phase)] = phases.get(str(record.phase), 0) + 1
        executions = {effect: c["executions"] for effect, c in effects_of(payments, notifier, task.uid).items()}
        assert all(n <= 1 for n in executions.values()), f"{name}: an effect executed twice: {executions}"
        events = [h.event for h in system.ledger.history(task.uid)]
        assert "freeze" not in events, f"{name} was frozen by the ledger's witness: {events}"
        assert record.frozen_reason is None
        if str(record.phase) == "NeedsAttention":
            unfinished = [s.name for s in record.steps if s.state != StepState.DONE]
            assert unfinished[:1] == ["notify"], f"{name}: NeedsAttention at {unfinished}, not at notify"
        else:
            assert str(record.phase) == "Succeeded", f"{name}: {record.phase} ({record.reason}, {record.last_error})"
            assert executions.get("notify") == 1 and all(s.state == StepState.DONE for s in record.steps)
        assert status(system, name).get("phase") == str(record.phase)
    retries = system.operator.log_tail(chars=10**8).count("ledger: transient error, retrying")
    print(f"phases {phases}; {time.monotonic() - started:.0f}s from the first submission; "
          f"{retries} ledger operations of the operator retried", flush=True)
