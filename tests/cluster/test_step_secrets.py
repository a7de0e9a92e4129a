"""Credentials named, never written: an exec step's env and an http step's
headers take `valueFrom.secretKeyRef`. A real Secret's value reaches the step (the exec step checks
it, the http step sends it to a capturing server on this host) and appears in none of the Task's
spec or status, the Job, or any row of the ledger.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import uuid

import psycopg
import pytest

from e2e.system import task_manifest


@pytest.fixture
def capture(rig):
    """An http destination that records the Authorization header of every request, where the
    cluster's pods reach this host."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((rig.pod_host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{rig.pod_host}:{server.server_address[1]}", seen
    server.shutdown()


def ledger_text(dsn: str) -> str:
    """Every row of every table of the ledger's schema, as text."""
    with psycopg.connect(dsn) as conn:
        tables = [t for (t,) in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'retex' "
            "AND table_type = 'BASE TABLE'")]
        assert "tasks" in tables and "steps" in tables, tables
        return "\n".join(str(row) for table in tables
                         for row in conn.execute(f"SELECT t::text FROM retex.{table} t"))


def test_a_secret_key_reaches_the_step_env_and_http_header_and_never_the_task_job_or_ledger(retex, capture):
    url, seen = capture
    value = f"s3cr3t-{uuid.uuid4()}"
    retex.kubectl("create", "secret", "generic", "shop-api", f"--from-literal=token={value}")
    from_secret = {"secretKeyRef": {"name": "shop-api", "key": "token"}}
    digest = hashlib.sha256(value.encode()).hexdigest()
    steps = [
        # Exit 0 only if the variable holds the value (the Task carries its hash, not the value).
        {"name": "env", "idempotent": True, "exec": {
            "command": ["sh", "-c", f'[ "$(printf %s "$API_TOKEN" | sha256sum | cut -d" " -f1)" = "{digest}" ]'],
            "env": [{"name": "API_TOKEN", "valueFrom": from_secret}]}},
        {"name": "header", "idempotent": True, "http": {
            "method": "GET", "url": f"{url}/orders",
            "headersFrom": [{"name": "Authorization", "valueFrom": from_secret}]}},
    ]
    retex.kubectl("apply", "-f", "-", input=task_manifest("uses-secret", steps, retry={"maxAttempts": 1}))
    waited = retex.kubectl("wait", "--for=condition=Succeeded", "--timeout=90s", "task/uses-secret", check=False)
    shown = retex.kubectl("get", "task", "uses-secret", "-o", "json").stdout
    assert waited.returncode == 0, f"{shown}\n{retex.operator.log_tail()}"

    assert seen == [value]  # the http step sent the Secret's value as its header
    task = json.loads(shown)
    assert task["spec"]["steps"][0]["exec"]["env"] == [{"name": "API_TOKEN", "value": "", "valueFrom": from_secret}]
    assert value not in shown  # spec and status
    jobs = retex.kubectl("get", "jobs", "-o", "json").stdout
    assert "shop-api" in jobs and value not in jobs  # the Job names the Secret, the kubelet resolves it
    assert value not in ledger_text(retex.dsn)
