"""The ledger endpoint's own decisions, with its collaborators faked (the rig tests in
tests/cluster/test_tenancy.py send the same attacks through a real API server and Postgres):
who may act for which attempt, what a request may carry, and that no caller can tie it up.
And the worker's client against canned answers: what it retries, what it raises."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from e2e.rig import pki as pkilib
from retex.kube.identity import NotAWorker, WorkerIdentity
from retex.kube.objects import job_name
from retex.ledger import RESULT_LIMIT_BYTES, FenceRejected, LedgerUnavailable, TaskNotFound
from retex.ledger.wire import RequestRefused
from retex.operator.endpoint_limits import Quota
from retex.operator.ledger_endpoint import (
    MAX_BODY_BYTES,
    EndpointLimits,
    LedgerEndpoint,
    LedgerTls,
    Refusal,
    parse_request,
    serve,
)
from retex.worker.ledger_client import LedgerClient

UID, OTHER = "11111111-aaaa", "22222222-bbbb"


class Record:
    def __init__(self, uid, namespace, name):
        self.uid, self.namespace, self.name = uid, namespace, name


class FakeLedger:
    committed: list

    def __init__(self):
        self.committed = []
        self.tasks = {UID: Record(UID, "shop", "order"), OTHER: Record(OTHER, "bank", "payout")}
        self.calls = []
        self.sent_jobs = {}  # (uid, epoch) → the Job name the relay recorded

    def attempts(self, uid):
        return [SimpleNamespace(epoch=epoch, job_name=name) for (u, epoch), name in self.sent_jobs.items() if u == uid]

    def get(self, uid):
        if uid not in self.tasks:
            raise TaskNotFound(uid)
        self.calls.append(("get", uid))
        return self.tasks[uid]

    def begin_step(self, uid, epoch, *, idx, actor, request=None):
        self.calls.append(("begin_step", uid, epoch, idx, actor) + ((request,) if request else ()))
        return None

    def commit_step(self, uid, epoch, idx, result, *, actor):
        self.committed.append(result)

    def claim_attempt(self, uid, epoch, *, pod, node):
        self.calls.append(("claim_attempt", uid, epoch, pod, node))
        return None


class FakeIdentities:
    def __init__(self, tokens):
        self.tokens = tokens

    def cached(self, token):
        return self.tokens.get(token)

    def resolve(self, token):
        if token not in self.tokens:
            raise NotAWorker("token not accepted for audience retex-ledger: unauthenticated")
        return self.tokens[token]


def worker(namespace="shop", uid=UID, epoch=2, job=None):
    return WorkerIdentity(namespace=namespace, pod="order-x-2-abcde", service_account="retex-worker",
                          job_name=job or job_name("order", UID, epoch), task_uid=uid, epoch=epoch)


def endpoint(**tokens):
    ledger = FakeLedger()
    return LedgerEndpoint(ledger, FakeIdentities(tokens)), ledger


def call(ep, operation, token, body):
    return ep.call(operation, ep.identify(token), body)


def refused(fn) -> Refusal:
    with pytest.raises(Refusal) as caught:
        fn()
    return caught.value


def test_the_attempt_and_the_actor_come_from_the_token_never_from_the_request():
    ep, ledger = endpoint(good=worker())
    call(ep, "begin_step", "good", {"uid": UID, "epoch": 2, "idx": 0})
    call(ep, "claim_attempt", "good", {"uid": UID, "epoch": 2, "node": "n1"})
    assert ("begin_step", UID, 2, 0, "worker:order-x-2-abcde") in ledger.calls
    assert ("claim_attempt", UID, 2, "order-x-2-abcde", "n1") in ledger.calls


def test_a_request_for_another_task_or_epoch_is_refused_before_the_ledger_is_touched():
    ep, ledger = endpoint(good=worker())
    assert refused(lambda: call(ep, "begin_step", "good", {"uid": OTHER, "epoch": 2, "idx": 0})).status == 403
    assert refused(lambda: call(ep, "begin_step", "good", {"uid": UID, "epoch": 3, "idx": 0})).status == 403
    assert ledger.calls == []


def test_a_pod_of_another_namespace_or_another_job_is_no_worker_and_is_not_told_whose_task_it_named():
    for forged in (worker(namespace="attacker"), worker(job="order-lookalike-2")):
        ep, ledger = endpoint(forged=forged)
        refusal = refused(lambda: call(ep, "begin_step", "forged", {"uid": UID, "epoch": 2, "idx": 0}))  # noqa: B023
        assert refusal.status == 403 and "is not a worker of task" in str(refusal)
        assert "shop" not in str(refusal).replace(forged.namespace, "") and "order/" not in str(refusal)
        assert not [c for c in ledger.calls if c[0] != "get"]


def test_a_worker_of_a_task_gone_from_the_ledger_learns_it_as_task_not_found():
    ep, ledger = endpoint(good=worker())
    del ledger.tasks[UID]
    with pytest.raises(TaskNotFound):
        call(ep, "begin_step", "good", {"uid": UID, "epoch": 2, "idx": 0})


def test_a_pod_of_the_job_the_relay_recorded_is_a_worker_even_if_this_release_would_name_it_otherwise():
    """Job names were cut at 63 characters before; an attempt in flight across the upgrade keeps
    its Job, whose name the relay recorded when it sent it."""
    old_name = "order-" + "x" * 57
    ep, ledger = endpoint(old=worker(job=old_name), stranger=worker(job="order-y-0000-2"))
    ledger.sent_jobs[(UID, 2)] = old_name
    call(ep, "begin_step", "old", {"uid": UID, "epoch": 2, "idx": 0})
    assert refused(lambda: call(ep, "begin_step", "stranger", {"uid": UID, "epoch": 2, "idx": 0})).status == 403


def test_a_token_that_is_not_a_workers_is_refused_401():
    ep, _ = endpoint()
    assert refused(lambda: ep.identify("stolen")).status == 401


@pytest.mark.parametrize("operation, body", [
    ("commit_step", {"uid": UID, "epoch": 2, "idx": 0}),  # no result: never commit null by omission
    ("fail_step", {"uid": UID, "epoch": 2, "idx": 0, "error": "x"}),  # no retryable
    ("fail_step", {"uid": UID, "epoch": 2, "idx": 0, "error": "x", "retryable": "yes"}),
    ("begin_step", {"uid": UID, "epoch": 2, "idx": -1}),
    ("begin_step", {"uid": UID, "epoch": 2, "idx": True}),
    ("begin_step", {"uid": UID, "epoch": 2, "idx": 0, "actor": "cli:root"}),  # no option to pass
    ("begin_step", {"uid": UID, "epoch": 2, "idx": 0, "request": ""}),
    ("begin_step", {"uid": UID, "epoch": 2, "idx": 0, "request": "x" * 65}),
    ("seconds_until_step_deadline", {"uid": UID, "idx": 0, "begun_at": "yesterday", "after_seconds": 5}),
])
def test_a_request_missing_an_argument_or_carrying_a_wrong_or_extra_one_is_refused_400(operation, body):
    assert refused(lambda: parse_request(operation, body)).status == 400


def test_a_well_formed_request_becomes_the_ledger_methods_arguments():
    at = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)
    assert parse_request("seconds_until_step_deadline", {"uid": UID, "idx": 1, "begun_at": at.isoformat(),
                                                         "after_seconds": 2.5}) == \
        {"idx": 1, "begun_at": at, "after_seconds": 2.5}
    assert parse_request("commit_step", {"uid": UID, "epoch": 2, "idx": 0, "result": None}) == {"idx": 0, "result": None}
    assert parse_request("begin_step", {"uid": UID, "epoch": 2, "idx": 0, "request": "r1"}) == {"idx": 0, "request": "r1"}
    # A worker of the release before request ids sends none.
    assert parse_request("begin_step", {"uid": UID, "epoch": 2, "idx": 0}) == {"idx": 0}


# -- the HTTP plumbing: nobody can tie it up -------------------------------------------------------


class AnyPod:
    """Every token is a worker: the pod (and namespace) named by the token."""

    def cached_identity(self, token):
        return WorkerIdentity(namespace=token, pod=token, service_account="retex-worker", job_name="j",
                              task_uid=UID, epoch=2)

    identify = cached_identity


class SlowEndpoint(AnyPod):
    """Holds every call until released: shows how many run at once."""

    def __init__(self):
        self.release = threading.Event()

    def call(self, operation, identity, body):
        self.release.wait(10)
        return {"ok": True}


@pytest.fixture
def server():
    slow = SlowEndpoint()
    served = serve(slow, 0, None, limits=EndpointLimits(max_concurrent=2))
    yield served.server_address[1], slow
    slow.release.set()
    served.shutdown()
    served.server_close()


def raw(port, request: bytes, timeout=5.0) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return sock.recv(65536).decode(errors="replace")


def post(port, headers: dict, body: bytes = b"{}") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", "/v1/attempt/get", body=body, headers=headers)
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read() or b"{}")


def test_no_token_is_refused_before_the_body_is_read(server):
    port, _ = server
    # A body announced but never sent: without a token the endpoint answers at once.
    answer = raw(port, b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
    assert answer.startswith("HTTP/1.0 401") or answer.startswith("HTTP/1.1 401"), answer


@pytest.mark.parametrize("length, status", [("-1", 400), ("0", 400), (str(MAX_BODY_BYTES + 1), 413), ("many", 400),
                                            (None, 411)])
def test_a_body_length_that_is_negative_empty_too_large_or_missing_is_refused_at_once(server, length, status):
    port, _ = server
    announced = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    answer = raw(port, b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n"
                       + f"{announced}\r\n".encode())
    assert answer.split(" ")[1] == str(status), answer


def test_requests_past_the_concurrency_cap_are_answered_503_at_once(server):
    port, slow = server
    holders = [threading.Thread(target=post, args=(port, {"Authorization": f"Bearer pod-{n}"})) for n in range(2)]
    for t in holders:
        t.start()
    time.sleep(0.3)  # both slots taken by calls the fake holds
    started = time.monotonic()
    status, reply = post(port, {"Authorization": "Bearer pod-3"})
    assert status == 503 and "busy" in reply["message"] and time.monotonic() - started < 2
    slow.release.set()
    for t in holders:
        t.join(5)


# -- the worker's client: what it retries and what it raises ---------------------------------------


class Canned(BaseHTTPRequestHandler):
    answers: list[tuple[int, dict]] = []
    seen: list[str] = []
    bodies: list[dict] = []
    at: list[float] = []

    def do_POST(self):  # noqa: N802
        Canned.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        Canned.seen.append(self.path)
        status, payload, *headers = Canned.answers.pop(0) if len(Canned.answers) > 1 else Canned.answers[0]
        Canned.at.append(time.monotonic())
        data = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers[0] if headers else {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def canned(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("t")
    Canned.seen, Canned.bodies, Canned.at = [], [], []

    def client(*answers, retry_for=0.5):
        Canned.answers = list(answers)
        return LedgerClient(f"http://127.0.0.1:{server.server_address[1]}", str(token), retry_for_seconds=retry_for)

    yield client
    server.shutdown()
    server.server_close()


def test_an_outage_is_retried_and_the_answer_after_it_is_taken(canned):
    client = canned((503, {"message": "busy"}), (502, {}), (200, {"result": 4.5}))
    assert client.seconds_until_step_deadline(UID, 0, begun_at=None, after_seconds=1) == 4.5
    assert len(Canned.seen) == 3


def test_past_its_window_the_client_keeps_trying_only_while_told_to(canned):
    client = canned((503, {"message": "operator restarting"}), retry_for=0.2)
    tries = iter([True, True, False])
    client.keep_trying = lambda: next(tries)
    with pytest.raises(LedgerUnavailable):
        client.start_run(UID, 2, 0, actor="w")
    assert len(Canned.seen) >= 4


def test_a_refusal_for_load_is_retried_no_sooner_than_the_endpoint_asks_and_the_answer_after_it_taken(canned):
    client = canned((429, {"message": "over its pod's rate limit"}, {"Retry-After": "1"}), (200, {"result": 4.5}))
    assert client.seconds_until_step_deadline(UID, 0, begun_at=None, after_seconds=1) == 4.5
    assert len(Canned.at) == 2 and Canned.at[1] - Canned.at[0] >= 1.0


def test_an_endpoint_answering_busy_is_waited_for_past_the_window_an_unreachable_one_is_not(canned):
    """Before its Lease a worker has only the window: an endpoint that answers "busy" (it is up,
    and serving others) must not make it give up the attempt, which would count a disruption."""
    busy = (503, {"message": "the ledger endpoint is busy: try again"}, {"Retry-After": "1"})
    client = canned(busy, busy, busy, (200, {"result": 4.5}), retry_for=0.2)
    assert client.seconds_until_step_deadline(UID, 0, begun_at=None, after_seconds=1) == 4.5
    assert len(Canned.seen) == 4


def test_a_ledger_error_comes_back_as_its_own_type(canned):
    client = canned((409, {"error": "FenceRejected", "message": "fenced",
                           "args": {"uid": UID, "epoch": 2, "current_epoch": 3, "phase": "Running"}}))
    with pytest.raises(FenceRejected) as fenced:
        client.commit_step(UID, 2, 0, {"id": 1}, actor="w")
    assert fenced.value.current_epoch == 3


def test_a_refusal_of_the_caller_is_raised_at_once_and_a_server_bug_after_a_few_tries(canned):
    with pytest.raises(RequestRefused):
        canned((403, {"message": "not a worker"})).get(UID)
    assert len(Canned.seen) == 1
    Canned.seen.clear()
    with pytest.raises(RequestRefused):
        canned((500, {"message": "KeyError"}), retry_for=30).get(UID)
    assert len(Canned.seen) == 3


def test_an_error_text_is_cut_to_what_the_ledger_keeps_before_it_is_sent(canned):
    client = canned((200, {"result": None}))
    with pytest.raises(AttributeError):  # the canned result is no task record; only what was sent matters
        client.fail_step(UID, 2, 0, "x" * (3 << 20), retryable=False, actor="w")
    assert len(Canned.bodies[0]["error"]) == 4096


# -- TLS: a token goes only to the endpoint whose certificate the operator's CA signed -------------


class AnswerGet(AnyPod):
    def call(self, operation, identity, body):
        return 7.5


tls_server_of: dict = {}  # port → the server, for the tests that look inside it


@pytest.fixture
def tls_server(tmp_path):
    pki = pkilib.ledger_serving(tmp_path / "tls")
    tls = LedgerTls(str(pki.crt("ledger")), str(pki.key("ledger")), str(pki.ca_crt))
    served = serve(AnswerGet(), 0, tls)
    tls_server_of[served.server_address[1]] = served
    token = tmp_path / "token"
    token.write_text("t")
    yield served.server_address[1], tls, str(token), pki
    served.shutdown()
    served.server_close()


def test_a_worker_trusting_the_operators_ca_is_served_over_tls(tls_server):
    port, tls, token, _ = tls_server
    client = LedgerClient(f"https://127.0.0.1:{port}", token, retry_for_seconds=1, ca_pem=tls.ca_pem())
    assert client.seconds_until_step_deadline(UID, 0, begun_at=None, after_seconds=1) == 7.5


def test_a_worker_refuses_an_endpoint_whose_certificate_another_ca_signed_and_sends_no_token(tls_server, tmp_path):
    port, _, token, _ = tls_server
    stranger = pkilib.ledger_serving(tmp_path / "stranger")
    client = LedgerClient(f"https://127.0.0.1:{port}", token, retry_for_seconds=5,
                          ca_pem=stranger.ca_crt.read_text())
    started = time.monotonic()
    with pytest.raises(RequestRefused, match="certificate does not verify"):
        client.get(UID)
    assert time.monotonic() - started < 2, "refused at once: no retry cures a certificate"


def test_plain_http_to_the_tls_endpoint_gets_no_answer(tls_server):
    port, *_ = tls_server
    answer = raw(port, b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n"
                       b"Content-Length: 2\r\n\r\n{}")
    assert "200" not in answer and "7.5" not in answer


def test_a_client_that_never_finishes_its_handshake_holds_up_nobody(tls_server):
    port, tls, token, _ = tls_server
    with socket.create_connection(("127.0.0.1", port)):  # connects, sends nothing
        client = LedgerClient(f"https://127.0.0.1:{port}", token, retry_for_seconds=1, ca_pem=tls.ca_pem())
        assert client.seconds_until_step_deadline(UID, 0, begun_at=None, after_seconds=1) == 7.5


def test_a_rotated_certificate_is_served_to_the_connections_after_it(tls_server, tmp_path):
    port, tls, token, pki = tls_server
    rotated = pkilib.ledger_serving(tmp_path / "rotated")
    for name in ("crt", "key"):
        target = getattr(pki, name)("ledger")
        target.write_bytes(getattr(rotated, name)("ledger").read_bytes())
        os.utime(target, (time.time() + 5, time.time() + 5))  # a new mtime, whatever the clock's grain
    fresh = LedgerClient(f"https://127.0.0.1:{port}", token, retry_for_seconds=1, ca_pem=rotated.ca_crt.read_text())
    assert fresh.seconds_until_step_deadline(UID, 0, begun_at=None, after_seconds=1) == 7.5


def test_the_endpoint_replies_without_waiting_for_the_workers_delayed_ack(tls_server):
    # A reply sent in two writes (headers, then body) under Nagle's algorithm waits for the
    # worker's delayed ACK of the first (~40 ms on Linux): that stall was most of each ledger call,
    # two per step (docs/benchmarks.md). Every accepted connection has TCP_NODELAY.
    port, tls, token, _ = tls_server
    served = tls_server_of[port]
    client = LedgerClient(f"https://127.0.0.1:{port}", token, retry_for_seconds=1, ca_pem=tls.ca_pem())
    assert client.seconds_until_step_deadline(UID, 0, begun_at=None, after_seconds=1) == 7.5
    sockets = [handler.transport.get_extra_info("socket") for handler in served.http.connections]
    assert sockets and [sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in sockets] == [1]


# -- no caller ties up the endpoint for the others --------------------------------------------------


def post_as(port, token: str, operation: str, body: dict, timeout=5.0) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", f"/v1/attempt/{operation}", body=json.dumps(body).encode(),
                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read() or b"{}"), dict(reply.getheaders())


def test_a_caller_whose_token_is_refused_is_answered_401_before_it_sends_its_body():
    served = serve(endpoint()[0], 0, None)
    try:
        answer = raw(served.server_address[1], b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\n"
                                               b"Authorization: Bearer forged\r\nContent-Length: 60000\r\n\r\n", timeout=3)
        assert answer.split(" ")[1] == "401", answer
    finally:
        served.shutdown()
        served.server_close()


def test_callers_trickling_bodies_under_refused_tokens_leave_every_slot_to_the_workers():
    ep, ledger = endpoint(good=worker())
    served = serve(ep, 0, None, limits=EndpointLimits(max_concurrent=2))
    port = served.server_address[1]
    tricklers = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        for n, sock in enumerate(tricklers):
            sock.sendall(f"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer forged-{n}\r\n"
                         f"Content-Length: 1000\r\n\r\n{{".encode())
        time.sleep(0.5)
        status, reply, _ = post_as(port, "good", "begin_step", {"uid": UID, "epoch": 2, "idx": 0})
        assert status == 200, reply
    finally:
        for sock in tricklers:
            sock.close()
        served.shutdown()
        served.server_close()


def test_a_pod_flooding_the_endpoint_is_answered_429_with_retry_after_and_another_tenant_is_still_served():
    flooder = worker()
    victim = WorkerIdentity(namespace="bank", pod="payout-y-1-fghij", service_account="retex-worker",
                            job_name=job_name("payout", OTHER, 1), task_uid=OTHER, epoch=1)
    ep, _ = endpoint(flood=flooder, victim=victim)
    served = serve(ep, 0, None, limits=EndpointLimits(per_pod=Quota(rate=20, burst=40, concurrent=2)))
    port = served.server_address[1]
    try:
        answers = [post_as(port, "flood", "begin_step", {"uid": UID, "epoch": 2, "idx": 0}) for _ in range(200)]
        refused = [headers for status, _, headers in answers if status == 429]
        assert refused, f"200 calls in a burst from one pod, none refused: {sorted({a[0] for a in answers})}"
        assert all(float(headers["Retry-After"]) > 0 for headers in refused)
        status, reply, _ = post_as(port, "victim", "begin_step", {"uid": OTHER, "epoch": 1, "idx": 0})
        assert status == 200, reply
    finally:
        served.shutdown()
        served.server_close()


def test_a_request_whose_body_trickles_past_the_deadline_is_cut_off_and_its_slot_freed():
    ep, _ = endpoint(good=worker())
    served = serve(ep, 0, None, limits=EndpointLimits(request_seconds=1.0))
    port = served.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/attempt/begin_step HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\n"
                         b"Content-Length: 100\r\n\r\n")
            started, answer = time.monotonic(), b""
            while not answer and time.monotonic() - started < 4:
                sock.sendall(b" ")  # a byte every 0.2 s: each read is quick, the request never ends
                time.sleep(0.2)
                sock.setblocking(False)
                try:
                    answer = sock.recv(4096)
                except BlockingIOError:
                    pass
                sock.setblocking(True)
            assert answer.split(b" ")[1] == b"408", answer
        # The pod's concurrency slot is free again: its next calls are served.
        for _ in range(3):
            status, reply, _ = post_as(port, "good", "begin_step", {"uid": UID, "epoch": 2, "idx": 0})
            assert status == 200, reply
    finally:
        served.shutdown()
        served.server_close()


def test_a_connection_that_trickles_its_headers_is_closed_at_the_header_deadline():
    served = serve(endpoint()[0], 0, None, limits=EndpointLimits(header_seconds=1.0))
    try:
        with socket.create_connection(("127.0.0.1", served.server_address[1]), timeout=5) as sock:
            started, closed = time.monotonic(), False
            for byte in b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"x" * 100:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                sock.setblocking(False)
                try:
                    closed = sock.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed = True
                sock.setblocking(True)
                if closed:
                    break
                time.sleep(0.1)
            assert closed and time.monotonic() - started < 3
    finally:
        served.shutdown()
        served.server_close()


def test_connections_past_the_cap_for_one_address_are_dropped_at_once_and_a_closed_one_frees_its_place():
    served = serve(endpoint()[0], 0, None, limits=EndpointLimits(max_connections_per_address=3))
    port = served.server_address[1]
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            assert extra.recv(1) == b"", "the connection past the cap is closed without a byte read"
        held.pop().close()
        time.sleep(0.2)
        answer = raw(port, b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        assert answer.split(" ")[1] == "401", answer
    finally:
        for sock in held:
            sock.close()
        served.shutdown()
        served.server_close()


def test_the_largest_legal_step_result_is_committed_and_a_body_past_its_size_is_refused_413():
    ep, ledger = endpoint(good=worker())
    served = serve(ep, 0, None)
    port = served.server_address[1]
    try:
        # The worker's own encoding (json.dumps) of a result at the ledger's limit, escapes included.
        result = {"text": "\u00e9" * ((RESULT_LIMIT_BYTES - 12) // 6)}
        assert RESULT_LIMIT_BYTES - 6 < len(json.dumps(result).encode()) <= RESULT_LIMIT_BYTES
        status, reply, _ = post_as(port, "good", "commit_step", {"uid": UID, "epoch": 2, "idx": 0, "result": result})
        assert status == 200, reply
        assert ledger.committed == [result]
        too_big = {"uid": UID, "epoch": 2, "idx": 0, "result": "x" * MAX_BODY_BYTES}
        assert post_as(port, "good", "commit_step", too_big)[0] == 413
    finally:
        served.shutdown()
        served.server_close()


def test_a_namespace_flooding_from_many_pods_is_held_to_its_quota_and_another_namespace_is_served():
    flooders = {f"flood-{n}": WorkerIdentity(namespace="shop", pod=f"order-{n}", service_account="retex-worker",
                                             job_name=job_name("order", UID, 2), task_uid=UID, epoch=2)
                for n in range(6)}
    victim = WorkerIdentity(namespace="bank", pod="payout-y-1-fghij", service_account="retex-worker",
                            job_name=job_name("payout", OTHER, 1), task_uid=OTHER, epoch=1)
    ep, _ = endpoint(victim=victim, **flooders)
    limits = EndpointLimits(per_pod=Quota(rate=1000, burst=1000, concurrent=4),
                            per_namespace=Quota(rate=0.5, burst=10, concurrent=4))
    served = serve(ep, 0, None, limits=limits)
    port = served.server_address[1]
    try:
        statuses = [post_as(port, token, "begin_step", {"uid": UID, "epoch": 2, "idx": 0})[0]
                    for _ in range(5) for token in flooders]
        assert statuses.count(200) <= 12 and statuses.count(429) >= 18, statuses
        assert post_as(port, "victim", "begin_step", {"uid": OTHER, "epoch": 1, "idx": 0})[0] == 200
    finally:
        served.shutdown()
        served.server_close()


class LargeReplies(AnyPod):
    """Tokens `namespace.pod`; every call answers a reply of `size` bytes."""

    def __init__(self, size):
        self.size = size

    def cached_identity(self, token):
        namespace, pod = token.split(".")
        return WorkerIdentity(namespace=namespace, pod=pod, service_account="retex-worker", job_name="j",
                              task_uid=UID, epoch=2)

    identify = cached_identity

    def call(self, operation, identity, body):
        return {"blob": "x" * self.size}


def slow_reader(port, token, tls: ssl.SSLContext | None) -> socket.socket:
    """Asks for a reply and reads none of it, through a receive window of a few KiB."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname="127.0.0.1")
    body = json.dumps({"uid": UID}).encode()
    sock.sendall(b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode()
                 + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def tls_post_as(port, tls: ssl.SSLContext | None, token: str, operation: str, body: dict) -> tuple[int, dict, dict]:
    if tls is None:
        return post_as(port, token, operation, body)
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=tls)
    conn.request("POST", f"/v1/attempt/{operation}", body=json.dumps(body).encode(),
                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read() or b"{}"), dict(reply.getheaders())


@pytest.mark.parametrize("over_tls", [False, True], ids=["plain", "tls"])
def test_replies_held_by_slow_readers_are_bounded_and_one_namespace_holds_only_its_share(over_tls, tmp_path):
    tls, client_tls = None, None
    if over_tls:  # TLS buffers what it encrypts apart from the socket: the budget must hold there too
        pki = pkilib.ledger_serving(tmp_path / "tls")
        tls = LedgerTls(str(pki.crt("ledger")), str(pki.key("ledger")), str(pki.ca_crt))
        client_tls = ssl.create_default_context(cafile=str(pki.ca_crt))
    served = serve(LargeReplies(3 << 20), 0, tls, limits=EndpointLimits(reply_budget_bytes=8 << 20))
    port = served.server_address[1]
    held = slow_reader(port, "shop.reader-1", client_tls)
    try:
        time.sleep(0.5)  # its 3 MiB reply is being written, at the pace it reads
        status, reply, headers = tls_post_as(port, client_tls, "shop.reader-2", "get", {"uid": UID})
        assert status == 503 and float(headers["Retry-After"]) > 0, (status, reply)
        # Another namespace's reply fits in what the first left.
        status, reply, _ = tls_post_as(port, client_tls, "bank.reader-3", "get", {"uid": UID})
        assert status == 200 and len(reply["result"]["blob"]) == 3 << 20
        held.close()
        time.sleep(0.5)  # the slow reader gone, its reply's bytes are free again
        assert tls_post_as(port, client_tls, "shop.reader-2", "get", {"uid": UID})[0] == 200
    finally:
        held.close()
        served.shutdown()
        served.server_close()


def test_a_reply_still_being_written_at_the_deadline_is_cut_off_and_its_connection_closed():
    served = serve(LargeReplies(3 << 20), 0, None, limits=EndpointLimits(request_seconds=1.0))
    port = served.server_address[1]
    held = slow_reader(port, "shop.reader-1", None)
    try:
        time.sleep(3)  # well past the deadline, the reply far from read
        assert served.http._count._count == 0, "the slow reader's connection is still open"
        assert served._replies.held == 0
        held.settimeout(5)
        sent = b""
        while chunk := held.recv(1 << 20):
            sent += chunk
        assert b"took over" not in sent, "a 408 was written into the 200's body"
    finally:
        held.close()
        served.shutdown()
        served.server_close()


def test_a_reader_gone_while_its_reply_is_written_is_no_error_of_the_endpoint(caplog):
    served = serve(LargeReplies(3 << 20), 0, None)
    port = served.server_address[1]
    try:
        for n in range(3):
            reader = slow_reader(port, f"shop.reader-{n}", None)
            time.sleep(0.3)
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            reader.close()  # a reset, mid-reply
        time.sleep(0.5)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert served._replies.held == 0
    finally:
        served.shutdown()
        served.server_close()
