"""What a committed step survives: Postgres restarts, crashes and outages mid-run."""

import threading
import time

import pytest

from retex.ledger import Ledger, LedgerUnavailable
from retex.machine import StepState, TaskPhase
from tests.integration.ledger_helpers import admitted


@pytest.mark.parametrize("outage", ["restart", "crash"])
def test_a_postgres_restart_mid_run_loses_no_committed_step_and_the_run_carries_on(own_postgres, outage):
    with Ledger(own_postgres.dsn(), retry_for_seconds=60) as ledger:
        uid = admitted(ledger)
        ledger.begin_step(uid, 1, 0, actor="worker")
        ledger.commit_step(uid, 1, 0, {"charged": 1}, actor="worker")
        if outage == "restart":
            own_postgres.restart()
        else:
            own_postgres.kill()  # SIGKILL of postmaster and backends: a power cut as far as we care
            own_postgres.start()
        # The pool's connections died with the server; the next operations reconnect by themselves.
        ledger.begin_step(uid, 1, 1, actor="worker")
        ledger.commit_step(uid, 1, 1, {"shipped": 1}, actor="worker")
        record = ledger.get(uid)
    assert [s.state for s in record.steps] == [StepState.DONE, StepState.DONE, StepState.PENDING]
    assert record.steps[0].result == {"charged": 1}
    assert record.phase == TaskPhase.RUNNING


def test_an_operation_during_an_outage_waits_and_lands_once_postgres_is_back(own_postgres):
    with Ledger(own_postgres.dsn(), retry_for_seconds=60) as ledger:
        uid = admitted(ledger)
        ledger.begin_step(uid, 1, 0, actor="worker")
        own_postgres.stop()
        restarter = threading.Timer(2.0, own_postgres.start)
        restarter.start()
        started = time.monotonic()
        ledger.commit_step(uid, 1, 0, "ok", actor="worker")
        waited = time.monotonic() - started
        restarter.join()
        assert waited >= 1.5
        assert ledger.get(uid).steps[0].state == StepState.DONE
        assert [h.event for h in ledger.history(uid)].count("step-commit") == 1


def test_an_outage_longer_than_the_retry_window_raises_a_typed_error(own_postgres):
    with Ledger(own_postgres.dsn(), retry_for_seconds=2) as ledger:
        uid = admitted(ledger)
        own_postgres.stop()
        with pytest.raises(LedgerUnavailable):
            ledger.get(uid)
        own_postgres.start()
        assert ledger.get(uid).epoch == 1


def test_commits_are_durable_even_when_the_server_default_is_asynchronous(dsn, postgres):
    import psycopg

    dbname = dsn.split("dbname=")[1].split()[0]
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {dbname} SET synchronous_commit = off")
    with Ledger(dsn) as ledger, ledger._pool.connection() as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "on"


def test_a_connection_the_server_ended_right_after_its_use_is_replaced_and_the_operation_lands(dsn):
    # The pool hands a connection returned moments ago out again without a check (a round trip
    # per transaction otherwise): one the server ended meanwhile fails its first statement, and
    # the operation's retry takes it to a new connection.
    import psycopg

    with Ledger(dsn, max_connections=1) as ledger:
        uid = admitted(ledger)
        with ledger._pool.connection() as conn:
            pid = conn.info.backend_pid
        with psycopg.connect(dsn, autocommit=True) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s, 5000) AS ended", (pid,)).fetchone()[0]
        ledger.begin_step(uid, 1, 0, actor="worker")
        # The fault reached the operation: the ended connection came back broken from it, not from a check.
        assert ledger._pool.get_stats().get("returns_bad") == 1
        with ledger._pool.connection() as conn:
            assert conn.info.backend_pid != pid
        assert ledger.get(uid).steps[0].state == StepState.STARTED
        assert [h.event for h in ledger.history(uid)].count("step-begin") == 1


def test_a_session_that_turned_read_only_is_replaced_and_the_operation_lands(dsn):
    # A primary demoted in a switchover serves its sessions on as a standby: every write there
    # fails "read-only transaction" for ever. The ledger drops such a session and reconnects,
    # where a DSN with target_session_attrs=read-write reaches the new primary. Here the one
    # pooled session is made read-only; a new one takes writes.
    with Ledger(dsn, max_connections=1) as ledger:
        uid = admitted(ledger)
        with ledger._pool.connection() as conn:
            conn.execute("SET default_transaction_read_only = on")
            conn.commit()
            pid = conn.info.backend_pid
        ledger.begin_step(uid, 1, 0, actor="worker")
        with ledger._pool.connection() as conn:
            assert conn.info.backend_pid != pid
            assert conn.execute("SHOW default_transaction_read_only").fetchone()[0] == "off"
        assert ledger.get(uid).steps[0].state == StepState.STARTED
        assert [h.event for h in ledger.history(uid)].count("step-begin") == 1
