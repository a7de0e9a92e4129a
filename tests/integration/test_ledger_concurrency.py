"""Races the ledger must win: fencing against a new attempt, concurrent relays, concurrent start-up."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from retex.ledger import FenceRejected, Ledger
from retex.ledger.migrate import available, migrate
from tests.integration.ledger_helpers import admission, admitted


@pytest.mark.parametrize("write", ["begin", "commit", "fail", "flag", "complete"])
def test_every_worker_write_with_a_stale_epoch_is_rejected(ledger, write):
    uid = admitted(ledger, steps=("only",))
    ledger.begin_step(uid, 1, 0, actor="worker")
    if write == "complete":
        ledger.commit_step(uid, 1, 0, "ok", actor="worker")
    ledger.replace_attempt(uid, 1, cause="lease-expired")
    calls = {
        "begin": lambda: ledger.begin_step(uid, 1, 0, actor="zombie"),
        "commit": lambda: ledger.commit_step(uid, 1, 0, "late", actor="zombie"),
        "fail": lambda: ledger.fail_step(uid, 1, 0, "late", retryable=True, actor="zombie"),
        "flag": lambda: ledger.flag_step(uid, 1, 0, "late", actor="zombie"),
        "complete": lambda: ledger.complete_task(uid, 1, actor="zombie"),
    }
    before = ledger.get(uid).version
    with pytest.raises(FenceRejected) as rejected:
        calls[write]()
    assert (rejected.value.epoch, rejected.value.current_epoch) == (1, 2)
    assert ledger.get(uid).version == before
    assert "zombie" not in {h.actor for h in ledger.history(uid)}


def test_a_stale_commit_racing_a_new_attempt_lands_before_it_or_not_at_all(ledger):
    """Many rounds of commit(epoch 1) against replace_attempt(1) on two connections at once."""
    outcomes = {"committed": 0, "fenced": 0}
    for _ in range(30):
        uid = admitted(ledger, steps=("only",))
        ledger.begin_step(uid, 1, 0, actor="worker")
        start = threading.Barrier(2)

        def commit(uid: str, start: threading.Barrier) -> str:
            start.wait()
            try:
                ledger.commit_step(uid, 1, 0, "charged", actor="worker")
                return "committed"
            except FenceRejected:
                return "fenced"

        def replace(uid: str, start: threading.Barrier) -> None:
            start.wait()
            ledger.replace_attempt(uid, 1, cause="lease-expired")

        with ThreadPoolExecutor(2) as pool:
            committed, _ = pool.submit(commit, uid, start), pool.submit(replace, uid, start)
            outcomes[committed.result()] += 1
        events = [(h.event, h.epoch) for h in ledger.history(uid)]
        replaced_at = events.index(("replace-attempt", 2))
        epoch1_commits = [i for i, e in enumerate(events) if e == ("step-commit", 1)]
        assert all(i < replaced_at for i in epoch1_commits), events
        assert len(epoch1_commits) == (1 if committed.result() == "committed" else 0)
    assert sum(outcomes.values()) == 30


def test_concurrent_relays_never_send_one_dispatch_twice(ledger, dsn):
    uids = {ledger.admit(admission()).uid for _ in range(60)}
    sent: list[str] = []
    lock = threading.Lock()

    def relay():
        while True:
            batch, outcomes = ledger.dispatch_batch(limit=5, claim_seconds=60)
            if not batch:
                return
            for dispatch in batch:
                with lock:
                    sent.append(dispatch.task_uid)
                assert outcomes.sent(dispatch, f"job-{dispatch.task_uid}")

    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(relay) for _ in range(4)]:
            future.result()
    assert sorted(sent) == sorted(uids)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM retex.outbox WHERE sent_at IS NULL").fetchone()[0] == 0


def test_a_relay_that_dies_before_settling_leaves_the_dispatch_for_the_next_one_once_its_claim_lapses(ledger):
    uid = admitted(ledger)
    batch, _ = ledger.dispatch_batch(limit=20, claim_seconds=0.5)  # and dies: nothing settled
    assert [d.task_uid for d in batch] == [uid]
    time.sleep(0.7)
    batch, _ = ledger.dispatch_batch(limit=20, claim_seconds=60)
    assert [d.task_uid for d in batch] == [uid]


def test_a_superseded_dispatch_is_marked_stale_not_relayed(ledger):
    uid = admitted(ledger)
    ledger.replace_attempt(uid, 1, cause="lease-expired")
    batch, _ = ledger.dispatch_batch(limit=20, claim_seconds=60)
    assert [(d.task_uid, d.epoch) for d in batch] == [(uid, 2)]


def test_migrations_run_once_when_many_processes_start_at_once(dsn):
    start = threading.Barrier(6)

    def boot():
        with psycopg.connect(dsn) as conn:
            start.wait()
            return migrate(conn)

    with ThreadPoolExecutor(6) as pool:
        applied = [f.result() for f in [pool.submit(boot) for _ in range(6)]]
    every_version = [v for v, _, _ in available()]
    assert sorted(applied) == [[]] * 5 + [every_version]
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT array_agg(version ORDER BY version) FROM retex.schema_version").fetchone()[0] == every_version


def test_an_edited_migration_is_refused(dsn):
    with psycopg.connect(dsn) as conn:
        migrate(conn)
        conn.execute("UPDATE retex.schema_version SET checksum = 'tampered'")
        with pytest.raises(RuntimeError, match="edited after it was applied"):
            migrate(conn)


def test_notify_reports_each_committed_change_with_its_version(ledger):
    changes = ledger.listen(timeout=0.2)
    assert next(changes) is None  # listening, nothing yet
    uid = admitted(ledger)
    seen = set()
    for change in changes:
        if change is None:
            break
        seen.add(change)
    assert (uid, ledger.get(uid).version) in seen


def test_a_second_ledger_process_starts_on_an_already_migrated_database(dsn):
    with Ledger(dsn) as first, Ledger(dsn) as second:
        uid = admitted(first)
        assert second.get(uid).epoch == 1
