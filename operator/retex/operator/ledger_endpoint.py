"""The ledger endpoint: the only way a worker reaches the ledger (workers hold no DSN).

`POST /v1/attempt/<operation>` with the worker's pod-bound, audience-bound ServiceAccount token.
The caller's attempt comes from the token (retex.kube.identity), never from the request: a
request that names another task or epoch is refused, and so is a pod whose task lives in another
namespace or whose Job is not the one the operator builds for that attempt. Each operation then
runs as the same fenced Ledger method the worker used to call itself, so the epoch fence stays in
the transaction of the write. Errors go back as the ledger's own (retex.ledger.wire).

Served over TLS (`LedgerTls`: a serving certificate whose CA the workers are handed), so a token
read off the pod network cannot be replayed; plain HTTP only where the operator was told it may
(`RETEX_LEDGER_INSECURE=1`, docs/security.md). The certificate files are read again when they
change (a rotated Secret), for the connections that follow.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from retex.kube.identity import IdentityUnavailable, NotAWorker, WorkerIdentities, WorkerIdentity
from retex.kube.objects import job_name
from retex.ledger import Ledger, LedgerError, LedgerUnavailable, TaskRecord
from retex.ledger.wire import OPERATIONS, PATH_PREFIX, UNFENCED, error_to_json, time_from_json, to_json
from retex.logs import log_line
from retex.machine import IllegalTransition

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20  # a step result is at most 64 KiB; errors are cut to 4 KiB
# Requests served at once; past it, 503 at once (the worker retries). Each holds a thread and, for
# its transaction, a connection of the endpoint's pool.
MAX_CONCURRENT_REQUESTS = 32
SOCKET_TIMEOUT_SECONDS = 30


class Refusal(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# What each argument of a request must be; a request with anything else is refused (400) before
# it reaches the ledger, so a missing `result` never commits null and a stray key is no option.
_ARGUMENTS: dict[str, Callable[[Any], bool]] = {
    "idx": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "node": lambda v: v is None or isinstance(v, str),
    "begun_at": lambda v: v is None or isinstance(v, str),
    "after_seconds": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e7,
    "result": lambda v: True,
    "error": lambda v: isinstance(v, str),
    "retryable": lambda v: isinstance(v, bool),
    "why": lambda v: isinstance(v, str),
    "request": lambda v: isinstance(v, str) and 0 < len(v) <= 64,
}
# A worker of the release before request ids sends none: it is served as before.
_OPTIONAL = frozenset({"request"})


def parse_request(operation: str, body: dict[str, Any]) -> dict[str, Any]:
    """The Ledger method's keyword arguments from a request body, strictly; Refusal(400) else."""
    expected = set(OPERATIONS[operation]) | {"uid"} | (set() if operation in UNFENCED else {"epoch"})
    if not expected - _OPTIONAL <= set(body) <= expected:
        raise Refusal(400, f"{operation} takes exactly {sorted(expected)}, got {sorted(body)}")
    kwargs = {name: body[name] for name in OPERATIONS[operation] if name in body}
    for name, value in kwargs.items():
        if not _ARGUMENTS[name](value):
            raise Refusal(400, f"{operation}: {name}={value!r} is not valid")
    if "begun_at" in kwargs:
        try:
            kwargs["begun_at"] = time_from_json(kwargs["begun_at"])
        except ValueError:
            raise Refusal(400, f"{operation}: begun_at is not an ISO time") from None
    return kwargs


class LedgerEndpoint:
    """Authorises a call and runs it; the HTTP plumbing is `serve`."""

    def __init__(self, ledger: Ledger, identities: WorkerIdentities):
        self._ledger = ledger
        self._identities = identities
        # (pod, task, epoch) already checked against the ledger: a task's namespace and name never
        # change. Bounded: cleared when full (a re-check costs one read).
        self._verified: set[WorkerIdentity] = set()
        self._lock = threading.Lock()

    def call(self, operation: str, token: str, body: dict[str, Any]) -> Any:
        if operation not in OPERATIONS:
            raise Refusal(404, f"no operation {operation!r}")
        try:
            identity = self._identities.resolve(token)
        except NotAWorker as exc:
            raise Refusal(401, str(exc)) from None
        except IdentityUnavailable as exc:
            raise Refusal(503, str(exc)) from None
        self._authorise(identity, operation, body)
        kwargs = parse_request(operation, body)
        method = getattr(self._ledger, operation)
        if operation in UNFENCED:
            return to_json(method(identity.task_uid, **kwargs))
        if operation == "claim_attempt":
            return to_json(method(identity.task_uid, identity.epoch, pod=identity.pod, **kwargs))
        return to_json(method(identity.task_uid, identity.epoch, actor=f"worker:{identity.pod}", **kwargs))

    def _authorise(self, identity: WorkerIdentity, operation: str, body: dict[str, Any]) -> None:
        if body.get("uid") != identity.task_uid or (operation not in UNFENCED and body.get("epoch") != identity.epoch):
            raise Refusal(403, f"pod {identity.namespace}/{identity.pod} runs attempt {identity.epoch} of task "
                               f"{identity.task_uid}; it may not act for task {body.get('uid')} epoch {body.get('epoch')}")
        with self._lock:
            if identity in self._verified:
                return
        record = self._ledger.get(identity.task_uid)  # TaskNotFound: 409, the worker exits as stale
        if record.namespace != identity.namespace or identity.job_name not in self._job_names(record, identity.epoch):
            # Says nothing of the task itself: a caller may name any uid.
            raise Refusal(403, f"pod {identity.namespace}/{identity.pod} (Job {identity.job_name}) is not a worker "
                               f"of task {identity.task_uid}")
        with self._lock:
            if len(self._verified) >= _VERIFIED_LIMIT:
                self._verified.clear()
            self._verified.add(identity)

    def _job_names(self, record: TaskRecord, epoch: int) -> set[str]:
        """The names the attempt's Job may have: the one this operator builds, and the one the
        relay recorded when it sent the attempt (a Job made by an earlier release, whose names
        were longer, keeps its name through an upgrade)."""
        names = {job_name(record.name, record.uid, epoch)}
        names.update(a.job_name for a in self._ledger.attempts(record.uid) if a.epoch == epoch and a.job_name)
        return names


_VERIFIED_LIMIT = 10_000


@dataclass(frozen=True)
class LedgerTls:
    """The endpoint's serving certificate and key (PEM files, e.g. a kubernetes.io/tls Secret
    mounted), and the CA that signed it, which workers are handed to verify it."""

    cert_file: str
    key_file: str
    ca_file: str

    def ca_pem(self) -> str:
        return open(self.ca_file).read()


class _ServingContext:
    """An SSLContext whose certificate is loaded again when its files change."""

    def __init__(self, tls: LedgerTls):
        self._tls = tls
        self._lock = threading.Lock()
        self._loaded: tuple[float, float] | None = None
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.refresh()

    def refresh(self) -> None:
        stamp = (os.stat(self._tls.cert_file).st_mtime, os.stat(self._tls.key_file).st_mtime)
        with self._lock:
            if stamp != self._loaded:
                self.context.load_cert_chain(self._tls.cert_file, self._tls.key_file)
                self._loaded = stamp


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    serving: _ServingContext | None = None
    serving_thread: threading.Thread  # set by serve()

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        if self.serving is None:
            return conn, address
        try:
            self.serving.refresh()
        except (OSError, ssl.SSLError) as exc:  # a rotation half written: keep the loaded pair
            log_line(log, logging.WARNING, "ledger endpoint: certificate not reloaded", error=str(exc))
        # The handshake happens in the request's own thread (_Handler.setup), under its socket
        # timeout: a client that never completes one ties up nothing but that thread.
        return self.serving.context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False), address

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed handshake or a dropped client: the client's problem, one line, no traceback.
        log_line(log, logging.INFO, "ledger endpoint: connection dropped", client=client_address[0])


class _Handler(BaseHTTPRequestHandler):
    endpoint: LedgerEndpoint
    slots: threading.BoundedSemaphore
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_SECONDS  # a client that stops sending (or never sends) is dropped
    # TCP_NODELAY: a reply is two writes (headers, body); under Nagle's algorithm the second waits
    # for the worker's delayed ACK of the first, ~40 ms on every call of a kept-alive connection.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()  # sets the socket timeout
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        # Cheap refusals first, before reading anything of the body: any pod of the cluster can
        # reach this port, and none may tie up the operator.
        if not self.slots.acquire(blocking=False):
            self._refuse(503, "the ledger endpoint is busy: try again")
            return
        try:
            self._serve()
        finally:
            self.slots.release()

    def _serve(self) -> None:
        if not self.path.startswith(PATH_PREFIX):
            self._refuse(404, f"unknown path {self.path}")
            return
        operation = self.path[len(PATH_PREFIX):]
        header = self.headers.get("Authorization", "")
        token = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        if not token:
            self._refuse(401, "no bearer token: workers present their projected ServiceAccount token")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._refuse(411, "a Content-Length is required")
            return
        if not 0 < length <= MAX_BODY_BYTES:
            self._refuse(413 if length > 0 else 400, f"the body must be 1 to {MAX_BODY_BYTES} bytes")
            return
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError as exc:
            self._refuse(400, f"the body is not JSON: {exc}")
            return
        if not isinstance(body, dict):
            self._refuse(400, "the body must be a JSON object")
            return
        try:
            self._reply(200, {"result": self.endpoint.call(operation, token, body)})
        except Refusal as exc:
            if exc.status in (401, 403):
                log_line(log, logging.WARNING, "ledger endpoint refused a caller", operation=operation,
                         status=exc.status, why=str(exc))
            self._refuse(exc.status, str(exc))
        except LedgerUnavailable as exc:
            self._reply(503, error_to_json(exc))
        except (LedgerError, IllegalTransition) as exc:
            self._reply(409, error_to_json(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here must not kill the server thread silently
            log_line(log, logging.ERROR, "ledger endpoint: operation failed", operation=operation, exc_info=True)
            self._reply(500, {"message": f"{type(exc).__name__}: {exc}"})

    def _refuse(self, status: int, message: str) -> None:
        self.close_connection = True  # whatever the caller sent after this is not read
        self._reply(status, {"message": message})

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # one structured line per refusal is logged above; successes are counted, not logged


def serve(endpoint: LedgerEndpoint, port: int, tls: LedgerTls | None, *,
          max_concurrent: int = MAX_CONCURRENT_REQUESTS) -> _Server:
    """Serve on `port`, over TLS unless `tls` is None (allowed only by RETEX_LEDGER_INSECURE)."""
    handler = type("LedgerHandler", (_Handler,), {"endpoint": endpoint,
                                                  "slots": threading.BoundedSemaphore(max_concurrent)})
    server = _Server(("0.0.0.0", port), handler)
    if tls is not None:
        server.serving = _ServingContext(tls)
    server.serving_thread = threading.Thread(target=server.serve_forever, name="ledger-endpoint", daemon=True)
    server.serving_thread.start()  # the readiness probe watches it
    return server
