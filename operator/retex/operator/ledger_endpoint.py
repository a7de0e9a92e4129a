"""The ledger endpoint: the only way a worker reaches the ledger (workers hold no DSN).

`POST /v1/attempt/<operation>` with the worker's pod-bound, audience-bound ServiceAccount token.
The caller's attempt comes from the token (retex.kube.identity), never from the request: a
request that names another task or epoch is refused, and so is a pod whose task lives in another
namespace or whose Job is not the one the operator builds for that attempt. Each operation then
runs as the same fenced Ledger method the worker used to call itself, so the epoch fence stays in
the transaction of the write. Errors go back as the ledger's own (retex.ledger.wire).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from retex.kube.identity import IdentityUnavailable, NotAWorker, WorkerIdentities, WorkerIdentity
from retex.kube.objects import job_name
from retex.ledger import Ledger, LedgerError, LedgerUnavailable, TaskNotFound
from retex.ledger.wire import OPERATIONS, PATH_PREFIX, UNFENCED, error_to_json, time_from_json, to_json
from retex.logs import event
from retex.machine import IllegalTransition

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20  # a step result is at most 64 KiB; errors are cut to 4 KiB


class Refusal(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LedgerEndpoint:
    """Authorises a call and runs it; the HTTP plumbing is `serve`."""

    def __init__(self, ledger: Ledger, identities: WorkerIdentities):
        self._ledger = ledger
        self._identities = identities
        self._verified: set[WorkerIdentity] = set()  # a task's namespace and name never change
        self._lock = threading.Lock()

    def call(self, operation: str, token: str | None, body: dict[str, Any]) -> Any:
        if operation not in OPERATIONS:
            raise Refusal(404, f"no operation {operation!r}")
        if not token:
            raise Refusal(401, "no bearer token: workers present their projected ServiceAccount token")
        try:
            identity = self._identities.resolve(token)
        except NotAWorker as exc:
            raise Refusal(401, str(exc)) from None
        except IdentityUnavailable as exc:
            raise Refusal(503, str(exc)) from None
        self._authorise(identity, operation, body)
        try:
            kwargs = {name: body.get(name) for name in OPERATIONS[operation]}
        except AttributeError:
            raise Refusal(400, "the body must be a JSON object") from None
        if "begun_at" in kwargs:
            kwargs["begun_at"] = time_from_json(kwargs["begun_at"])
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
        try:
            record = self._ledger.get(identity.task_uid)
        except TaskNotFound:
            raise Refusal(403, f"no task {identity.task_uid} in the ledger") from None
        expected = job_name(record.name, record.uid, identity.epoch)
        if record.namespace != identity.namespace or identity.job_name != expected:
            raise Refusal(403, f"pod {identity.namespace}/{identity.pod} (Job {identity.job_name}) is not a worker "
                               f"of task {record.namespace}/{record.name}: its attempt {identity.epoch} runs as "
                               f"Job {record.namespace}/{expected}")
        with self._lock:
            self._verified.add(identity)


class _Handler(BaseHTTPRequestHandler):
    endpoint: LedgerEndpoint
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if not self.path.startswith(PATH_PREFIX):
            self._reply(404, {"message": f"unknown path {self.path}"})
            return
        operation = self.path[len(PATH_PREFIX):]
        header = self.headers.get("Authorization", "")
        token = header[len("Bearer "):].strip() if header.startswith("Bearer ") else None
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise Refusal(413, f"request body above {MAX_BODY_BYTES} bytes")
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise Refusal(400, "the body must be a JSON object")
            self._reply(200, {"result": self.endpoint.call(operation, token, body)})
        except Refusal as exc:
            if exc.status in (401, 403):
                event(log, logging.WARNING, "ledger endpoint refused a caller", operation=operation,
                      status=exc.status, why=str(exc))
            self._reply(exc.status, {"message": str(exc)})
        except (ValueError, TypeError) as exc:
            self._reply(400, {"message": f"bad request: {exc}"})
        except LedgerUnavailable as exc:
            self._reply(503, error_to_json(exc))
        except (LedgerError, IllegalTransition) as exc:
            self._reply(409, error_to_json(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here must not kill the server thread silently
            log.exception("ledger endpoint: %s failed", operation)
            self._reply(500, {"message": f"{type(exc).__name__}: {exc}"})

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # one structured line per refusal is logged above; successes are counted, not logged


def serve(endpoint: LedgerEndpoint, port: int) -> ThreadingHTTPServer:
    handler = type("LedgerHandler", (_Handler,), {"endpoint": endpoint})
    server = ThreadingHTTPServer(("0.0.0.0", port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ledger-endpoint", daemon=True).start()
    return server
