"""The worker's API client (retex.kube.rest): its credentials, as the operator's client finds them
(a kubeconfig, else the pod's service account), and what its answers mean to the error predicates
(retex.kube.errors) and the Lease calls (retex.kube.leases). Against a tiny local HTTP(S) server
that answers what it is told to; the real API server is tests/cluster/test_worker_lease.py's."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import tempfile
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from e2e.rig import pki as pkilib
from retex.kube import errors, rest
from retex.kube.errors import ApiError, NamespaceTerminating
from retex.kube.leases import LeaseConflict, LeaseNotFound, read_lease, replace_lease
from retex.kube.rest import Credentials, CredentialsError, RestClient

LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kubeconfig(path: Path, cluster: dict, user: dict, *, context: str = "x") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": "c", "cluster": cluster}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}]}))
    return path


# --- credentials ------------------------------------------------------------------------------


def test_the_rigs_pod_kubeconfig_server_ca_and_token(tmp_path):
    # The shape e2e/rig/pki.write_kubeconfig gives each pod (the agent's TokenRequest).
    path = kubeconfig(tmp_path / "kubeconfig", {"server": "https://127.0.0.1:6443", "certificate-authority-data": b64("CA")},
                      {"token": "the-token"})
    assert Credentials.from_kubeconfig(str(path)) == Credentials(server="https://127.0.0.1:6443", ca_pem="CA",
                                                                 token="the-token")


def test_kubeconfig_files_named_in_it_are_relative_to_it(tmp_path):
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "client.crt").write_text("CERT")
    (tmp_path / "client.key").write_text("KEY")
    (tmp_path / "token").write_text("t")
    path = kubeconfig(tmp_path / "kubeconfig", {"server": "https://h", "certificate-authority": "ca.crt"},
                      {"client-certificate": "client.crt", "client-key": str(tmp_path / "client.key"), "tokenFile": "token"})
    found = Credentials.from_kubeconfig(str(path))
    assert (found.ca_pem, found.client_cert_pem, found.client_key_pem, found.token_file) == (
        "CA", "CERT", "KEY", tmp_path / "token")


def test_kubeconfig_list_the_first_file_naming_an_entry_wins(tmp_path):
    first = kubeconfig(tmp_path / "first", {"server": "https://first"}, {"token": "first"})
    second = kubeconfig(tmp_path / "second", {"server": "https://second"}, {"token": "second"}, context="other")
    found = Credentials.from_kubeconfig(f"{tmp_path / 'missing'}:{first}:{second}")
    assert (found.server, found.token) == ("https://first", "first")


@pytest.mark.parametrize("user", [{"exec": {"command": "aws"}}, {"auth-provider": {"name": "gcp"}},
                                  {"username": "u", "password": "p"}])
def test_kubeconfig_credentials_a_worker_pod_never_has_are_refused_by_name(tmp_path, user):
    path = kubeconfig(tmp_path / "kubeconfig", {"server": "https://h"}, user)
    with pytest.raises(CredentialsError, match="does not support"):
        Credentials.from_kubeconfig(str(path))


def test_kubeconfig_without_its_current_context_is_refused(tmp_path):
    path = kubeconfig(tmp_path / "kubeconfig", {"server": "https://h"}, {"token": "t"}, context="gone")
    with pytest.raises(CredentialsError, match="no current context 'gone'"):
        Credentials.from_kubeconfig(str(path))


def test_in_cluster_the_service_account_directory_and_the_services_address(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("t")
    (tmp_path / "ca.crt").write_text("CA")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert Credentials.in_cluster(tmp_path) == Credentials(server="https://[fd00::1]:443", ca_pem="CA",
                                                           token_file=tmp_path / "token")


def test_without_kubeconfig_outside_a_pod_there_are_no_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(CredentialsError, match="not in a pod"):
        Credentials.from_environment()


def test_kubeconfig_wins_over_the_service_account_as_for_the_operator(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", {"server": "https://h"}, {"token": "t"})))
    assert Credentials.from_environment().server == "https://h"


# --- a tiny API server ------------------------------------------------------------------------


class Server:
    """Answers each request with the next (status, body) of `answers` (the last one repeats);
    records the method, path, Authorization header, body and client certificate of each."""

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.answers: list[tuple[int, dict]] = [(200, {})]
        self.seen: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                peer = self.connection.getpeercert() if tls else None
                outer.seen.append({"method": self.command, "path": self.path,
                                   "authorization": self.headers.get("Authorization"),
                                   "body": json.loads(self.rfile.read(length)) if length else None,
                                   "peer": dict(item[0] for item in peer["subject"]) if peer else None})
                status, body = outer.answers[0] if len(outer.answers) == 1 else outer.answers.pop(0)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    served = Server()
    yield served
    served.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return pkilib.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_server(pki):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.crt("apiserver"), pki.key("apiserver"))
    context.load_verify_locations(pki.ca_crt)
    context.verify_mode = ssl.CERT_OPTIONAL  # a token-only client sends no certificate
    served = Server(context)
    yield served
    served.close()


def test_a_kubeconfig_with_a_client_certificate_is_served_over_verified_tls(tls_server, pki, tmp_path, monkeypatch):
    # The rig's admin kubeconfig (the workers of tests/cluster/test_worker_lease.py use it).
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    path = pkilib.write_kubeconfig(tmp_path / "kubeconfig", tls_server.url, pki.ca_crt, user="admin",
                                   client_crt=pki.crt("admin"), client_key=pki.key("admin"))
    tls_server.answers = [(200, {"kind": "Lease"})]
    assert read_lease(RestClient(Credentials.from_kubeconfig(str(path))), "ns", "l", timeout=5) == {"kind": "Lease"}
    assert tls_server.seen[-1]["peer"] == {"organizationName": "system:masters", "commonName": "retex-rig-admin"}
    assert tls_server.seen[-1]["authorization"] is None
    assert not list((tmp_path / "tmp").iterdir())  # the key's temporary copy is gone


def test_a_server_the_ca_did_not_sign_gets_no_token(tls_server, tmp_path):
    stranger = pkilib.ledger_serving(tmp_path / "stranger")
    path = pkilib.write_kubeconfig(tmp_path / "kubeconfig", tls_server.url, stranger.ca_crt, user="pod", token="secret")
    with pytest.raises(urllib3.exceptions.SSLError) as raised:
        RestClient(Credentials.from_kubeconfig(str(path))).call("GET", LEASE_PATH, timeout=5)
    assert errors.transient(raised.value)  # as the kubernetes client's status-0 ApiException is
    assert tls_server.seen == []


def test_a_projected_token_is_read_again_once_a_minute_old(server, tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("first\n")
    api = RestClient(Credentials(server=server.url, token_file=token))
    api.call("GET", LEASE_PATH, timeout=5)
    token.write_text("rotated\n")  # the kubelet rotates it
    api.call("GET", LEASE_PATH, timeout=5)
    monkeypatch.setattr(rest, "TOKEN_REREAD_SECONDS", 0.0)  # a minute later
    api.call("GET", LEASE_PATH, timeout=5)
    assert [seen["authorization"] for seen in server.seen] == ["Bearer first", "Bearer first", "Bearer rotated"]


def test_lease_calls_send_and_return_raw_json(server):
    api = RestClient(Credentials(server=server.url + "/", token="t"))
    body = {"metadata": {"name": "l", "resourceVersion": "7"}, "spec": {"renewTime": "2026-12-06T09:00:00.000000Z"}}
    server.answers = [(200, body)]
    assert replace_lease(api, "ns", "l", body, timeout=5) == body
    assert server.seen == [{"method": "PUT", "path": LEASE_PATH, "authorization": "Bearer t", "body": body, "peer": None}]


# --- what the answers mean --------------------------------------------------------------------


def status(code: int, message: str, causes: list[dict] | None = None) -> dict:
    return {"kind": "Status", "status": "Failure", "message": message, "code": code,
            **({"details": {"causes": causes}} if causes else {})}


def test_not_found_and_conflict_become_the_lease_calls_own_errors(server):
    api = RestClient(Credentials(server=server.url))
    server.answers = [(404, status(404, 'leases.coordination.k8s.io "l" not found'))]
    with pytest.raises(LeaseNotFound):
        read_lease(api, "ns", "l", timeout=5)
    server.answers = [(409, status(409, "the object has been modified"))]
    with pytest.raises(LeaseConflict):
        replace_lease(api, "ns", "l", {"metadata": {}}, timeout=5)


@pytest.mark.parametrize(("code", "message", "transient", "refused_for_good"), [
    (403, 'leases.coordination.k8s.io "l" is forbidden: User "u" cannot update resource "leases"', False, True),
    (403, 'exceeded quota: compute, requested: pods=1', True, False),
    (422, "Lease.coordination.k8s.io is invalid", False, True),
    (429, "too many requests", True, False),
    (500, "etcdserver: request timed out", True, False),
    (503, "the server is currently unable to handle the request", True, False),
])
def test_the_workers_errors_mean_what_the_operators_mean(server, code, message, transient, refused_for_good):
    server.answers = [(code, status(code, message))]
    with pytest.raises(ApiError) as raised:
        read_lease(RestClient(Credentials(server=server.url)), "ns", "l", timeout=5)
    lean = raised.value
    operators = ApiException(status=code, reason=lean.reason)
    operators.body = lean.body
    for exc in (lean, operators):
        assert (errors.transient(exc), errors.refused_for_good(exc)) == (transient, refused_for_good)
        assert (errors.forbidden(exc), errors.invalid(exc)) == (code == 403, code == 422)
        assert errors.api_message(exc) == message
    # What a worker's log shows of it: the status, its reason phrase, the server's message.
    assert str(lean) == f"({code} {HTTPStatus(code).phrase}) {message}"


def test_a_refusal_of_the_workers_client_is_read_like_the_operators(server):
    server.answers = [(403, status(403, 'unable to create new content in namespace ns because it is being terminated',
                                   [{"reason": "NamespaceTerminating", "message": "ns is terminating"}]))]
    with pytest.raises(ApiError) as raised:
        read_lease(RestClient(Credentials(server=server.url)), "ns", "l", timeout=5)
    assert isinstance(errors.refusal(raised.value), NamespaceTerminating)


def test_a_call_to_a_silent_server_ends_within_one_timeout_on_one_connection():
    # One attempt per call, as the operator's client (tests/unit/test_kube_client_retries.py).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    api = RestClient(Credentials(server=f"http://127.0.0.1:{listener.getsockname()[1]}", token="t"))
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError) as raised:
        read_lease(api, "ns", "l", timeout=0.5)
    took = time.monotonic() - started
    assert took < 1.0, f"the call took {took:.1f}s for a 0.5s timeout"
    assert errors.transient(raised.value)
    accepted = []
    listener.settimeout(0.1)
    try:
        while True:
            accepted.append(listener.accept()[0])
    except TimeoutError:
        pass
    assert len(accepted) == 1
    for conn in accepted:
        conn.close()
    listener.close()
