"""The ledger endpoint's own decisions, with its collaborators faked (the rig tests in
tests/cluster/test_tenancy.py send the same attacks through a real API server and Postgres):
who may act for which attempt, what a request may carry, and that no caller can tie it up.
And the worker's client against canned answers: what it retries, what it raises."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from e2e.rig import pki as pkilib
from retex.kube.identity import NotAWorker, WorkerIdentity
from retex.kube.objects import job_name
from retex.ledger import FenceRejected, LedgerUnavailable, TaskNotFound
from retex.ledger.wire import RequestRefused
from retex.operator.ledger_endpoint import LedgerEndpoint, LedgerTls, Refusal, parse_request, serve
from retex.worker.ledger_client import LedgerClient

UID, OTHER = "11111111-aaaa", "22222222-bbbb"


class Record:
    def __init__(self, uid, namespace, name):
        self.uid, self.namespace, self.name = uid, namespace, name


class FakeLedger:
    def __init__(self):
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

    def claim_attempt(self, uid, epoch, *, pod, node):
        self.calls.append(("claim_attempt", uid, epoch, pod, node))
        return None


class FakeIdentities:
    def __init__(self, tokens):
        self.tokens = tokens

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


def refused(fn) -> Refusal:
    with pytest.raises(Refusal) as caught:
        fn()
    return caught.value


def test_the_attempt_and_the_actor_come_from_the_token_never_from_the_request():
    ep, ledger = endpoint(good=worker())
    ep.call("begin_step", "good", {"uid": UID, "epoch": 2, "idx": 0})
    ep.call("claim_attempt", "good", {"uid": UID, "epoch": 2, "node": "n1"})
    assert ("begin_step", UID, 2, 0, "worker:order-x-2-abcde") in ledger.calls
    assert ("claim_attempt", UID, 2, "order-x-2-abcde", "n1") in ledger.calls


def test_a_request_for_another_task_or_epoch_is_refused_before_the_ledger_is_touched():
    ep, ledger = endpoint(good=worker())
    assert refused(lambda: ep.call("begin_step", "good", {"uid": OTHER, "epoch": 2, "idx": 0})).status == 403
    assert refused(lambda: ep.call("begin_step", "good", {"uid": UID, "epoch": 3, "idx": 0})).status == 403
    assert ledger.calls == []


def test_a_pod_of_another_namespace_or_another_job_is_no_worker_and_is_not_told_whose_task_it_named():
    for forged in (worker(namespace="attacker"), worker(job="order-lookalike-2")):
        ep, ledger = endpoint(forged=forged)
        refusal = refused(lambda: ep.call("begin_step", "forged", {"uid": UID, "epoch": 2, "idx": 0}))  # noqa: B023
        assert refusal.status == 403 and "is not a worker of task" in str(refusal)
        assert "shop" not in str(refusal).replace(forged.namespace, "") and "order/" not in str(refusal)
        assert not [c for c in ledger.calls if c[0] != "get"]


def test_a_worker_of_a_task_gone_from_the_ledger_learns_it_as_task_not_found():
    ep, ledger = endpoint(good=worker())
    del ledger.tasks[UID]
    with pytest.raises(TaskNotFound):
        ep.call("begin_step", "good", {"uid": UID, "epoch": 2, "idx": 0})


def test_a_pod_of_the_job_the_relay_recorded_is_a_worker_even_if_this_release_would_name_it_otherwise():
    """Job names were cut at 63 characters before; an attempt in flight across the upgrade keeps
    its Job, whose name the relay recorded when it sent it."""
    old_name = "order-" + "x" * 57
    ep, ledger = endpoint(old=worker(job=old_name), stranger=worker(job="order-y-0000-2"))
    ledger.sent_jobs[(UID, 2)] = old_name
    ep.call("begin_step", "old", {"uid": UID, "epoch": 2, "idx": 0})
    assert refused(lambda: ep.call("begin_step", "stranger", {"uid": UID, "epoch": 2, "idx": 0})).status == 403


def test_a_token_that_is_not_a_workers_is_refused_401():
    ep, _ = endpoint()
    assert refused(lambda: ep.call("get", "stolen", {"uid": UID})).status == 401


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


class SlowEndpoint:
    """Holds every call until released: shows how many run at once."""

    def __init__(self):
        self.release = threading.Event()

    def call(self, operation, token, body):
        self.release.wait(10)
        return {"ok": True}


@pytest.fixture
def server():
    slow = SlowEndpoint()
    served = serve(slow, 0, None, max_concurrent=2)
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


@pytest.mark.parametrize("length, status", [("-1", 400), ("0", 400), (str(2 << 20), 413), ("many", 411)])
def test_a_body_length_that_is_negative_empty_too_large_or_missing_is_refused_at_once(server, length, status):
    port, _ = server
    answer = raw(port, b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n"
                       + f"Content-Length: {length}\r\n\r\n".encode())
    assert answer.split(" ")[1] == str(status), answer


def test_requests_past_the_concurrency_cap_are_answered_503_at_once(server):
    port, slow = server
    headers = {"Authorization": "Bearer t", "Content-Type": "application/json"}
    holders = [threading.Thread(target=post, args=(port, headers)) for _ in range(2)]
    for t in holders:
        t.start()
    time.sleep(0.3)  # both slots taken by calls the fake holds
    started = time.monotonic()
    status, reply = post(port, headers)
    assert status == 503 and "busy" in reply["message"] and time.monotonic() - started < 2
    slow.release.set()
    for t in holders:
        t.join(5)


# -- the worker's client: what it retries and what it raises ---------------------------------------


class Canned(BaseHTTPRequestHandler):
    answers: list[tuple[int, dict]] = []
    seen: list[str] = []
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802
        Canned.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        Canned.seen.append(self.path)
        status, payload = Canned.answers.pop(0) if len(Canned.answers) > 1 else Canned.answers[0]
        data = json.dumps(payload).encode()
        self.send_response(status)
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
    Canned.seen, Canned.bodies = [], []

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


class AnswerGet:
    def call(self, operation, token, body):
        return 7.5


@pytest.fixture
def tls_server(tmp_path):
    pki = pkilib.ledger_serving(tmp_path / "tls")
    tls = LedgerTls(str(pki.crt("ledger")), str(pki.key("ledger")), str(pki.ca_crt))
    served = serve(AnswerGet(), 0, tls)
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


def test_the_endpoint_replies_without_waiting_for_the_workers_delayed_ack(tmp_path):
    # A reply goes out in two writes (headers, then body). With Nagle's algorithm on, the second
    # waits until the worker acknowledges the first, which the worker delays (~40 ms on Linux):
    # that stall was most of each ledger call, two per step (docs/benchmarks.md).
    pki = pkilib.ledger_serving(tmp_path / "tls")
    tls = LedgerTls(str(pki.crt("ledger")), str(pki.key("ledger")), str(pki.ca_crt))
    served = serve(AnswerGet(), 0, tls)
    accepted = []
    get_request = served.get_request

    def recording() -> tuple:
        conn, address = get_request()
        accepted.append(conn)
        return conn, address

    served.get_request = recording
    token = tmp_path / "token"
    token.write_text("t")
    try:
        client = LedgerClient(f"https://127.0.0.1:{served.server_address[1]}", str(token), retry_for_seconds=1,
                              ca_pem=tls.ca_pem())
        assert client.seconds_until_step_deadline(UID, 0, begun_at=None, after_seconds=1) == 7.5
        assert [conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for conn in accepted] == [1]
    finally:
        served.shutdown()
        served.server_close()
