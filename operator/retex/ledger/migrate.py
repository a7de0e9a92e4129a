"""Versioned SQL migrations, applied at start-up under a Postgres advisory lock.

Files are `migrations/NNNN_name.sql`, applied in order, each in its own transaction together with
its row in `retex.schema_version`. Two processes starting at once serialize on the lock; the second
finds nothing left to do.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources

import psycopg

# Arbitrary but fixed: the advisory lock key that serializes migrations ("retex" in ASCII).
MIGRATION_LOCK_KEY = 0x7265746578

_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def available() -> list[tuple[int, str, str]]:
    """(version, file name, SQL) for every shipped migration, in order."""
    found = []
    for entry in resources.files("retex.ledger").joinpath("migrations").iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text()))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..N without gaps, found {versions}")
    return found


def migrate(conn: psycopg.Connection) -> list[int]:
    """Apply pending migrations; return the versions applied by this call."""
    applied_now = []
    conn.autocommit = True
    conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
    try:
        conn.execute("CREATE SCHEMA IF NOT EXISTS retex")
        conn.execute(
            """CREATE TABLE IF NOT EXISTS retex.schema_version (
                   version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        done = {v: c for v, c in conn.execute("SELECT version, checksum FROM retex.schema_version")}
        for version, name, sql in available():
            checksum = hashlib.sha256(sql.encode()).hexdigest()
            if version in done:
                if done[version] != checksum:
                    raise RuntimeError(f"migration {name} was edited after it was applied")
                continue
            with conn.transaction():
                conn.execute(sql)
                conn.execute(
                    "INSERT INTO retex.schema_version (version, name, checksum) VALUES (%s, %s, %s)",
                    (version, name, checksum),
                )
            applied_now.append(version)
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied_now
