"""Session fixtures: a throwaway Postgres (and, through e2e.rig.fixtures, the local Kubernetes rig).

Servers start lazily, only when a test asks for them, and are torn down at the end of the session.
"""

from __future__ import annotations

import itertools

import psycopg
import pytest

from e2e.postgres import PostgresServer
from retex.ledger import Ledger

pytest_plugins = ["e2e.rig.fixtures"]


@pytest.fixture(scope="session")
def postgres() -> PostgresServer:
    """A real Postgres server for the whole session; tests may restart or kill it."""
    # Its own directory under /tmp, not pytest's: the server runs as `nobody`, who cannot
    # traverse pytest's root-only temporary tree.
    server = PostgresServer()
    server.start()
    yield server
    server.destroy()


@pytest.fixture
def own_postgres() -> PostgresServer:
    """A Postgres of this test's own, so stopping or restarting it disturbs no other test."""
    server = PostgresServer()
    server.start()
    yield server
    server.destroy()


_databases = itertools.count()


@pytest.fixture
def dsn(postgres) -> str:
    """A fresh, empty database on the session's Postgres: tests never see each other's rows."""
    name = f"test_{next(_databases)}"
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres.dsn(dbname=name)


@pytest.fixture
def ledger(dsn) -> Ledger:
    """A migrated ledger on a fresh database."""
    with Ledger(dsn, retry_for_seconds=30) as opened:
        yield opened


def pytest_collection_modifyitems(items):
    # Tests that use the servers are marked for them, so `-m "not postgres"` stays honest.
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & {"postgres", "ledger", "dsn"}:
            item.add_marker(pytest.mark.postgres)
        if fixtures & {"rig", "kube", "kubeconfig"}:
            item.add_marker(pytest.mark.cluster)
