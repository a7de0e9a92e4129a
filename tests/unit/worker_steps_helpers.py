"""Builders shared by the worker's step-runner tests, and a scriptable local HTTP server."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from retex.api.models import Step
from retex.worker.drain import Drain
from retex.worker.supervision import StepCall, Supervision, step_environment


def step(**fields) -> Step:
    return Step.model_validate({"name": "charge", **fields})


def call(**overrides) -> StepCall:
    fields = dict(task_uid="uid-1", step="charge", idempotency_key="uid-1:charge:abcd1234", attempt=2,
                  payload={"amount": 42}, results={"reserve": {"id": "r-1"}})
    return StepCall(**{**fields, **overrides})


def supervision(drain_seconds: float = 30.0, env: dict | None = None) -> Supervision:
    return Supervision(drain=Drain(drain_seconds), env=env if env is not None else step_environment(),
                       kill_grace_seconds=0.5)


def drain_after(sup: Supervision, seconds: float) -> threading.Timer:
    """SIGTERM arrives `seconds` from now, as the signal handler would record it."""
    timer = threading.Timer(seconds, sup.drain.begin)
    timer.start()
    return timer


class HttpStub:
    """A scripted HTTP server: every request is recorded, then answered by `reply`."""

    def __init__(self):
        self.requests: list[dict] = []
        self.reply = lambda handler: (200, {"ok": True})
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                stub.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                      "body": self.rfile.read(length)})
                answer = stub.reply(self)
                if answer is None:  # drop the connection without answering
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, body = answer
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *args: None  # a client that gave up is part of some tests
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, path="/charges", scheme="http"):
        return f"{scheme}://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
