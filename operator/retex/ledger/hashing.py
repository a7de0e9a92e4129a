"""The ledger's content hashes: a spec's, and a step's idempotency key. Apart from the store so
that the worker, which reaches the ledger over HTTP, can use them without importing psycopg."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def step_idempotency_key(uid: str, step_name: str, step_spec: Any) -> str:
    """`<task uid>:<step name>:<version>`: stable across attempts, new if the step changed."""
    version = hashlib.sha256(json.dumps(step_spec, sort_keys=True).encode()).hexdigest()[:8]
    return f"{uid}:{step_name}:{version}"


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
