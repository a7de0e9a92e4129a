"""The operator's API client makes one attempt per call: urllib3's default retries (three, each
with a fresh timeout) would stretch a call to a silent API server to 4× its request timeout, and
send a write long after the may_write check before it (retex.kube.client)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kubernetes import client

from retex.kube.client import api_client


@pytest.fixture
def silent_server():
    """A listening socket that accepts every connection and never answers; counts connections."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def test_a_call_to_a_silent_server_ends_within_one_timeout_on_one_connection(silent_server, tmp_path, monkeypatch):
    port, accepted = silent_server
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    core = client.CoreV1Api(api_client())
    timeout = 0.5
    for call in (lambda: core.read_namespaced_config_map("e", "x", _request_timeout=timeout),
                 lambda: core.create_namespaced_config_map("x", {"metadata": {"name": "e"}},
                                                           _request_timeout=timeout)):
        before = len(accepted)
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 — urllib3's timeout error, unwrapped
            call()
        took = time.monotonic() - started
        time.sleep(0.2)  # let the accept thread count
        assert took < 2 * timeout, f"the call took {took:.1f}s for a {timeout}s timeout"
        assert len(accepted) - before == 1
