"""The operator's probes on the rig, each answer from a real cause: Postgres stopped → not ready
(the body says Postgres) but still live, and ready again once it is back; a writer loop's round
made to hang (the failpoint in-loop-round=hang) → not ready, then not live; the lease watch's
thread made to die (in-lease-watch=raise) → neither live nor ready.

Each test runs one operator (the leader of its own election Lease) on a Postgres of its own, so
stopping it disturbs no other test."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import psycopg
import pytest

from e2e.system import OperatorProcess, install_crd, prepare_namespace, wait_for

_numbers = itertools.count()


@pytest.fixture
def start_operator(rig, own_postgres, tmp_path):
    started: list[OperatorProcess] = []

    def start(**env: str) -> OperatorProcess:
        number = next(_numbers)
        database, namespace = f"retex_probes_{number}", f"probes-{number}"
        with psycopg.connect(own_postgres.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {database}")
        install_crd(rig.kubectl)
        prepare_namespace(rig.kubectl, namespace)
        operator = OperatorProcess.on(rig, own_postgres.dsn(dbname=database), Path(tmp_path) / f"operator-{number}.log",
                                      extra_env={"RETEX_NAMESPACES": namespace, **env})
        operator.start()
        started.append(operator)
        return operator

    yield start
    for operator in started:
        operator.kill()
        print(f"--- operator log tail ---\n{operator.log_tail()}")


def answers(operator: OperatorProcess, path: str, status: int, says: str = ""):
    def check():
        try:
            got = operator.probe(path)
        except OSError:  # not serving yet
            return None
        return got[0] == status and says in got[1]

    return check


def test_postgres_stopped_makes_the_operator_unready_naming_postgres_but_it_stays_live(start_operator, own_postgres):
    operator = start_operator()
    wait_for(answers(operator, "/readyz", 200), timeout=60, what="the operator ready")
    own_postgres.stop()
    try:
        wait_for(answers(operator, "/readyz", 503, "postgres unreachable"), timeout=30,
                                what="readiness failing on Postgres")
        # Longer than a leader's writer loops may go without a round (15 s): Postgres is the
        # reason given, and liveness never fails, so an outage cannot become a restart storm.
        until = time.monotonic() + 20
        while time.monotonic() < until:
            assert operator.probe("/livez") == (200, "ok\n")
            time.sleep(1)
        assert operator.exited() is None
    finally:
        own_postgres.start()
    wait_for(answers(operator, "/readyz", 200), timeout=60, what="ready again once Postgres is back")


def test_a_hung_writer_loop_makes_the_operator_unready_then_not_live(start_operator):
    # The relay's period is 2 s: stale after 15 s (the minimum), wedged after 10 × 2 s + 5 s.
    operator = start_operator(RETEX_FAILPOINT="in-loop-round:relay=hang", RETEX_LOOP_WEDGE_FLOOR_SECONDS="5")
    started = time.monotonic()
    wait_for(lambda: "in-loop-round:relay fired" in operator.log_tail(20000), timeout=60, what="the relay hung")
    assert operator.probe("/livez") == (200, "ok\n"), "wedged before its round could have run 25 s"
    wait_for(answers(operator, "/readyz", 503, "loop relay has completed no round"), timeout=40,
             what="readiness failing on the stale relay")
    wait_for(answers(operator, "/livez", 503, "loop relay wedged"), timeout=40,
                       what="liveness failing on the wedged relay")
    assert time.monotonic() - started >= 25
    assert operator.probe("/healthz")[0] == 503


def test_a_dead_lease_watch_thread_makes_the_operator_neither_live_nor_ready(start_operator):
    operator = start_operator(RETEX_FAILPOINT="in-lease-watch=raise")
    wait_for(lambda: "in-lease-watch fired" in operator.log_tail(20000), timeout=60, what="the lease watch raised")
    # The thread died of it (the traceback threading prints), the process lives on ...
    wait_for(lambda: "FailpointRaised: failpoint in-lease-watch" in operator.log_tail(20000), timeout=30,
             what="the lease-watch thread dead")
    assert operator.exited() is None
    # ... and the reaper, blind for good, is a restart's business.
    wait_for(answers(operator, "/livez", 503, "thread(s) dead: lease-watch"), timeout=30,
             what="liveness failing on the dead lease watch")
    assert operator.probe("/readyz") == (503, "thread(s) dead: lease-watch\n")
