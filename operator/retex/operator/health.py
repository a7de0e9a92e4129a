"""The operator's health endpoint (RETEX_LIVENESS / --liveness, default :8080/healthz), served on
every replica, leader or standby: 200 while every thread of the Runtime is alive, else 503.
(kopf's own health endpoint runs only while kopf does, i.e. on the leader.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


def serve_health(url: str, healthy: Callable[[], bool]) -> ThreadingHTTPServer:
    where = urlparse(url)
    path = where.path or "/healthz"

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != path:
                self.send_error(404)
                return
            ok = healthy()
            body = b"ok\n" if ok else b"a background thread of the operator is dead\n"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass  # probes every few seconds: not worth a log line each

    server = ThreadingHTTPServer((where.hostname or "0.0.0.0", where.port or 8080), Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
