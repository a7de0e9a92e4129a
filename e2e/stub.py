"""A counting stub of an external system ("payments"), for proving exactly-once effects.

Every request is a *delivery*. The first delivery of an Idempotency-Key performs the *real
execution* (counted) and stores its response; later deliveries with that key replay it, as a
payment provider does. With --no-idempotency every delivery executes, so duplicates show. Counts
are persisted (written atomically after every change) so a restart of the stub loses nothing.

    POST /effects/<name>[?status=N][&fail_times=K][&ack_status=N][&delay=S]   perform (or replay) an effect
         status=N      answer N without executing (e.g. 400 to test permanent errors)
         fail_times=K  answer 503 to the first K deliveries of each key, then execute
         ack_status=N  execute, then answer N (an ingress answering 504 after the upstream committed)
         delay=S       slow processing: the effect lands S seconds after the request arrived, and
                       only then is it answered (a client that gives up earlier never hears)
    GET  /effects/<name>[/<key>] verify (query-first), the key from the path or the
                                 Idempotency-Key header: 200 + stored response if executed, else 404
    GET  /counts                 {"<name>/<key>": {"deliveries": d, "executions": e}}
    GET  /arrivals               {"<name>/<key>": n}: POSTs received so far, counted on arrival (before
                                 any delay), in memory only: shows a request is in flight
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse


class Ledger:
    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.state = json.loads(path.read_text()) if path.exists() else {"counts": {}, "responses": {}}
        self.arrivals: dict[str, int] = {}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)


def make_handler(ledger: Ledger, idempotent: bool):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the counts are the record
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (slow mode): the effect is counted all the same

        def do_GET(self):
            parts = urlparse(self.path).path.strip("/").split("/")
            with ledger.lock:
                if parts == ["counts"]:
                    return self._answer(200, ledger.state["counts"])
                if parts == ["arrivals"]:
                    return self._answer(200, ledger.arrivals)
                if parts[0] == "effects" and len(parts) in (2, 3):
                    key = parts[2] if len(parts) == 3 else self.headers.get("Idempotency-Key")
                    stored = ledger.state["responses"].get(f"{parts[1]}/{key}")
                    return self._answer(200, stored) if stored else self._answer(404, {"found": False})
            self._answer(404, {"error": "unknown path"})

        def do_POST(self):
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            if len(parts) != 2 or parts[0] != "effects":
                return self._answer(404, {"error": "unknown path"})
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            key = self.headers.get("Idempotency-Key") or f"anonymous-{uuid.uuid4()}"
            ident = f"{parts[1]}/{key}"
            with ledger.lock:
                ledger.arrivals[ident] = ledger.arrivals.get(ident, 0) + 1
            if "delay" in query:
                time.sleep(float(query["delay"]))  # outside the lock: other requests go on meanwhile
            with ledger.lock:
                count = ledger.state["counts"].setdefault(ident, {"deliveries": 0, "executions": 0})
                count["deliveries"] += 1
                if "status" in query:
                    ledger.save()
                    return self._answer(int(query["status"]), {"refused": True})
                if count["deliveries"] <= int(query.get("fail_times", 0)):
                    ledger.save()
                    return self._answer(503, {"error": "try again"})
                stored = ledger.state["responses"].get(ident)
                if stored is None or not idempotent:
                    count["executions"] += 1
                    # No key or request echo: the same effect answers alike in every run of a
                    # scenario, so a crash run's results can be compared with its control run's.
                    stored = {"effect": parts[1], "execution": count["executions"]}
                    ledger.state["responses"][ident] = stored
                ledger.save()
            self._answer(int(query.get("ack_status", 200)), stored)

    return Handler


def serve(port: int, state: Path, *, idempotent: bool = True, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(Ledger(state), idempotent))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (kind: the kind network's gateway)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--state", type=Path, required=True, help="file the counts persist in")
    parser.add_argument("--no-idempotency", action="store_true", help="execute every delivery")
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(Ledger(args.state), not args.no_idempotency))
    print(f"stub listening on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
