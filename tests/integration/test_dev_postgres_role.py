"""The dev overlay's Postgres gives the operator an ordinary role, not a superuser,
and the operator's ledger works with it: the overlay's own init SQL, run on a real
Postgres as the image runs it (as its superuser, once), then the ledger migrated and used through
the overlay's DSN user."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import psycopg
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict

from retex.ledger import Ledger

DEV = Path(__file__).resolve().parents[2] / "manifests" / "overlays" / "dev"


def rendered() -> list[dict]:
    built = subprocess.run(["kubectl", "kustomize", str(DEV)], check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(built) if doc]


@pytest.fixture
def dev_role(postgres):
    objects = rendered()
    init = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("retex-postgres-init"))
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].startswith("retex-operator-db"))
    dsn = conninfo_to_dict(base64.b64decode(secret["data"]["dsn"]).decode())
    with psycopg.connect(postgres.dsn(), autocommit=True) as admin:
        script = "\n".join(line for line in init["data"]["init-retex-role.sql"].splitlines()
                            if not line.startswith("--"))
        for statement in filter(str.strip, script.split(";")):
            admin.execute(statement)
    yield dsn
    with psycopg.connect(postgres.dsn(), autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {dsn['dbname']} WITH (FORCE)")
        admin.execute(f"DROP ROLE IF EXISTS {dsn['user']}")


def test_the_dev_operator_role_is_not_a_superuser_and_runs_the_ledger(postgres, dev_role):
    dsn = postgres.dsn(user=dev_role["user"], dbname=dev_role["dbname"])
    with psycopg.connect(dsn) as conn:
        rolsuper, createrole, createdb = conn.execute(
            "SELECT rolsuper, rolcreaterole, rolcreatedb FROM pg_roles WHERE rolname = current_user").fetchone()
    assert (rolsuper, createrole, createdb) == (False, False, False)
    with Ledger(dsn, retry_for_seconds=10) as ledger:  # migrations create and own the schema
        assert ledger.dead_letters(None) == []
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("CREATE ROLE intruder SUPERUSER")
