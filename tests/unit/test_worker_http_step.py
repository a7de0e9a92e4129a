"""http steps against a real local HTTP server: headers, bodies, status classification, timeouts,
lost connections, TLS verification and the verify convention."""

import dataclasses
import json
import socket
import ssl
import subprocess
import threading
import time

import pytest

from retex.api.models import SecretKeySelector
from retex.worker.outcomes import Failed, Found, NotFound, Succeeded, Unknown, VerifyFailed
from retex.worker.steps import http_step
from tests.unit.worker_steps_helpers import HttpStub, call, step, supervision


@pytest.fixture
def stub():
    server = HttpStub()
    yield server
    server.close()


def run(stub, method="POST", path="/charges", body=None, **step_fields):
    action = {"method": method, "url": stub.url(path)}
    if body is not None:
        action["body"] = body
    s = step(http=action, **step_fields)
    return http_step.run(s.http, s, call(), supervision())


def test_success_stores_status_and_json_body_and_sends_the_idempotency_key(stub):
    stub.reply = lambda h: (201, {"charge": "ch_1"})
    outcome = run(stub, body={"amount": 42})
    assert outcome == Succeeded({"status": 201, "body": {"charge": "ch_1"}})
    request = stub.requests[0]
    assert request["headers"]["Idempotency-Key"] == "uid-1:charge:abcd1234"
    assert request["headers"]["X-Retex-Attempt"] == "2" and request["headers"]["X-Retex-Step"] == "charge"
    assert request["headers"]["Content-Type"] == "application/json"
    assert json.loads(request["body"]) == {"amount": 42}


def test_without_a_body_a_post_sends_the_envelope_of_payload_and_results(stub):
    run(stub)
    assert json.loads(stub.requests[0]["body"]) == {
        "idempotencyKey": "uid-1:charge:abcd1234", "taskUid": "uid-1", "step": "charge", "attempt": 2,
        "payload": {"amount": 42}, "results": {"reserve": {"id": "r-1"}}}


def test_a_string_body_is_sent_as_is_and_a_get_sends_none(stub):
    run(stub, body="plain words")
    run(stub, method="GET", path="/status?x=1")
    assert stub.requests[0]["body"] == b"plain words"
    assert stub.requests[1]["body"] == b"" and stub.requests[1]["path"] == "/status?x=1"


def test_a_body_that_is_not_json_is_stored_as_text(stub):
    stub.reply = lambda h: (200, b"<html>ok</html>")
    assert run(stub) == Succeeded({"status": 200, "body": "<html>ok</html>"})


def test_a_large_body_is_bounded_and_marked(stub):
    stub.reply = lambda h: (200, {"blob": "x" * 100_000})
    result = run(stub).result
    assert result["bodyTruncated"] is True
    assert len(json.dumps(result["body"]).encode()) <= http_step.BODY_LIMIT_BYTES


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503])
def test_timeouts_throttling_and_server_errors_are_retryable_for_an_idempotent_step(stub, status):
    stub.reply = lambda h: (status, {"error": "busy"})
    outcome = run(stub, idempotent=True)
    assert isinstance(outcome, Failed) and outcome.retryable and f"HTTP {status}" in outcome.error


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
def test_timeouts_throttling_and_server_errors_are_unknown_for_a_step_that_is_not_idempotent(stub, status):
    # A gateway may answer 504 after the upstream committed: this proves nothing about the effect.
    stub.reply = lambda h: (status, {"error": "busy"})
    outcome = run(stub)
    assert isinstance(outcome, Unknown) and f"HTTP {status}" in outcome.error


def test_a_declared_status_is_a_clean_failure_even_for_a_step_that_is_not_idempotent(stub):
    stub.reply = lambda h: (503, {})
    assert run(stub, retryableStatuses=[503]) == Failed("HTTP 503: {}", retryable=True)
    assert run(stub, permanentStatuses=[503]) == Failed("HTTP 503: {}", retryable=False)


@pytest.mark.parametrize("status", [400, 402, 404, 409, 422, 301])
def test_other_statuses_fail_permanently_by_default(stub, status):
    stub.reply = lambda h: (status, {"error": "no"})
    outcome = run(stub)
    assert isinstance(outcome, Failed) and not outcome.retryable


def test_the_step_can_make_a_4xx_retryable_or_a_5xx_permanent(stub):
    stub.reply = lambda h: (409, {})
    assert run(stub, permanentStatuses=[400]).retryable
    stub.reply = lambda h: (503, {})
    assert not run(stub, retryableStatuses=[429], idempotent=True).retryable


def test_connection_refused_is_a_retryable_failure_nothing_was_sent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: refused
        s2 = step(http={"method": "POST", "url": f"http://127.0.0.1:{port}/x"})
        outcome = http_step.run(s2.http, s2, call(), supervision())
    assert isinstance(outcome, Failed) and outcome.retryable


def test_no_answer_within_the_step_timeout_is_unknown(stub):
    stub.reply = lambda h: (time.sleep(5), (200, {}))[1]
    started = time.monotonic()
    outcome = run(stub, timeoutSeconds=1)
    assert isinstance(outcome, Unknown) and time.monotonic() - started < 3


def test_connection_dropped_after_sending_is_unknown(stub):
    stub.reply = lambda h: None
    outcome = run(stub)
    assert isinstance(outcome, Unknown) and "after sending" in outcome.error
    assert len(stub.requests) == 1  # it did arrive: this is why the outcome is unknown


def test_tls_certificates_are_verified(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(key), "-out", str(cert), "-days", "1"], check=True, capture_output=True)
    server = HttpStub()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.server.socket = context.wrap_socket(server.server.socket, server_side=True)
    try:
        s = step(http={"method": "POST", "url": server.url(scheme="https")})
        outcome = http_step.run(s.http, s, call(), supervision())
    finally:
        server.close()
    assert isinstance(outcome, Failed) and "CERTIFICATE_VERIFY_FAILED" in outcome.error
    assert server.requests == []


def verify(stub, status, body=None):
    stub.reply = lambda h: (status, body if body is not None else {})
    s = step(http={"method": "POST", "url": stub.url()},
             verify={"http": {"method": "GET", "url": stub.url("/charges/by-key")}})
    return http_step.verify(s.verify.http, s, call(), supervision())


def test_verify_2xx_is_found_with_the_response_as_result(stub):
    assert verify(stub, 200, {"charge": "ch_1"}) == Found({"status": 200, "body": {"charge": "ch_1"}, "verified": True})
    assert stub.requests[0]["headers"]["Idempotency-Key"] == "uid-1:charge:abcd1234"


def test_verify_404_is_not_found_and_other_statuses_are_errors(stub):
    assert verify(stub, 404) == NotFound()
    assert isinstance(verify(stub, 500), VerifyFailed)
    assert isinstance(verify(stub, 403), VerifyFailed)


def test_a_header_value_http_client_cannot_encode_fails_before_anything_is_sent(stub):
    # http.client sends latin-1 only; the models let other text through (CR, LF and NUL they
    # refuse before any step runs: test_worker_attempt).
    s = step(http={"method": "POST", "url": stub.url(), "headers": {"X-Note": "日本"}})
    outcome = http_step.run(s.http, s, call(), supervision())
    assert isinstance(outcome, Failed) and not outcome.retryable
    assert "X-Note" in outcome.error and "nothing was sent" in outcome.error
    assert stub.requests == []


def with_secret_header(stub, monkeypatch, value: str):
    ref = SecretKeySelector(name="payments-api", key="bearer")
    monkeypatch.setenv(ref.env_name, value)  # as the Job puts it on the worker container
    s = step(http={"method": "POST", "url": stub.url(), "headersFrom": [
        {"name": "Authorization", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]})
    return http_step.run(s.http, s, call(), supervision())


def test_a_header_from_a_secret_is_sent_with_the_secrets_value(stub, monkeypatch):
    assert isinstance(with_secret_header(stub, monkeypatch, "Bearer tok-123"), Succeeded)
    assert stub.requests[0]["headers"]["Authorization"] == "Bearer tok-123"


@pytest.mark.parametrize("value", ["Bearer a\r\nX-Injected: 1", "Bearer 日本-tok"])
def test_a_secret_header_value_that_cannot_be_sent_fails_without_quoting_the_value(stub, monkeypatch, value):
    outcome = with_secret_header(stub, monkeypatch, value)
    assert isinstance(outcome, Failed) and "Authorization" in outcome.error and "nothing was sent" in outcome.error
    assert "Bearer" not in outcome.error and "tok" not in outcome.error and stub.requests == []


def exchange_threads_done() -> None:
    """Wait for every request thread run() left behind: whatever it would still send is sent by then."""
    for thread in threading.enumerate():
        if thread.name == "retex-http-step":
            thread.join(timeout=10)
            assert not thread.is_alive()


@pytest.mark.parametrize("gives_up", ["timeout", "drain", "lease"])
def test_a_request_the_worker_gave_up_on_while_resolving_is_never_sent_afterwards(stub, monkeypatch, gives_up):
    # Name resolution has no timeout of its own (getaddrinfo); a resolver 1.5 s slow stands in for
    # a slow DNS server. The worker gives up at 1 s; the request thread must then never send.
    real_getaddrinfo = socket.getaddrinfo

    def slow_getaddrinfo(*args, **kwargs):
        time.sleep(1.5)
        return real_getaddrinfo(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    sup = supervision()
    s = step(http={"method": "POST", "url": stub.url()}, timeoutSeconds=1 if gives_up == "timeout" else 30)
    if gives_up == "drain":
        sup = supervision(drain_seconds=1.0)
        sup.drain.begin()
    if gives_up == "lease":
        lost_at = time.monotonic() + 1.0
        sup = dataclasses.replace(sup, held=lambda: time.monotonic() < lost_at)
    started = time.monotonic()
    outcome = http_step.run(s.http, s, call(), sup)
    assert time.monotonic() - started < 1.4, outcome
    exchange_threads_done()
    assert stub.requests == [], f"sent after run() returned {outcome}"


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://2852039166/",
                                 "http://0xa9fea9fe/", "http://[fe80::1]:8080/", "http://[::ffff:169.254.169.254]/",
                                 "http://[fd00:ec2::254]/", "http://100.100.100.200/latest/meta-data/"])
def test_a_destination_resolving_to_a_link_local_or_metadata_address_fails_for_good_and_nothing_is_sent(url):
    """The API server refuses such URLs written as addresses; 2852039166 and 0xa9fea9fe are names it
    cannot judge, which resolve to 169.254.169.254 here."""
    s = step(http={"method": "GET", "url": url}, idempotent=True)
    outcome = http_step.run(s.http, s, call(), supervision())
    assert isinstance(outcome, Failed) and outcome.retryable is False, outcome
    assert "http steps may not reach link-local or cloud metadata addresses" in outcome.error, outcome
    assert "nothing was sent" in outcome.error
    verified = http_step.verify(s.http, s, call(), supervision())
    assert isinstance(verified, VerifyFailed) and "may not reach link-local" in verified.error, verified


def test_the_request_goes_to_the_address_that_was_checked_not_to_a_second_lookups_answer(stub, monkeypatch):
    """DNS rebinding: a name answers a harmless address when checked, then the metadata address.
    The connection is made to the first answer; the name is looked up once."""
    lookups = []
    real = socket.getaddrinfo

    def rebinding(host, port, *args, **kwargs):
        if host != "rebind.test":
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        address = "127.0.0.1" if len(lookups) == 1 else "169.254.169.254"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    stub.reply = lambda h: (200, {"ok": True})
    s = step(http={"method": "GET", "url": stub.url("/x").replace("127.0.0.1", "rebind.test")}, idempotent=True)
    assert http_step.run(s.http, s, call(), supervision()) == Succeeded({"status": 200, "body": {"ok": True}})
    assert len(stub.requests) == 1 and lookups == ["rebind.test"]


def test_a_destination_on_loopback_or_a_private_network_is_not_refused(stub):
    assert not http_step.forbidden_destination("127.0.0.1") and not http_step.forbidden_destination("10.1.2.3")
    assert not http_step.forbidden_destination("::1") and not http_step.forbidden_destination("fd00::1")
    stub.reply = lambda h: (200, {"ok": True})
    assert run(stub, method="GET", path="/x") == Succeeded({"status": 200, "body": {"ok": True}})
