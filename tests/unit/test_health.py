"""The operator's health endpoint: 200 while the Runtime says healthy, 503 once it does not,
404 elsewhere (served on every replica; the probes of manifests/base use it)."""

import threading
import urllib.error
import urllib.request

import pytest

from e2e.postgres import free_port
from retex.operator.health import serve_health


@pytest.fixture
def endpoint():
    healthy = threading.Event()
    healthy.set()
    port = free_port()
    server = serve_health(f"http://127.0.0.1:{port}/healthz", healthy.is_set)
    yield f"http://127.0.0.1:{port}", healthy
    server.shutdown()
    server.server_close()


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code


def test_healthz_answers_200_while_healthy_and_503_once_a_thread_died(endpoint):
    base, healthy = endpoint
    assert status(f"{base}/healthz") == 200
    healthy.clear()
    assert status(f"{base}/healthz") == 503


def test_any_other_path_is_not_found(endpoint):
    base, _ = endpoint
    assert status(f"{base}/metrics") == 404
