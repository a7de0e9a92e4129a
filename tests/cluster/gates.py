"""Gates for steps: a URL served where the pods reach this host (the rig's loopback, the kind
network's gateway) that answers 404 until the test opens it, then 200, and remembers when it was
last asked (on this host's clock: a step's heartbeat). Over HTTP because a pod on kind sees no file
of this host."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Gate:
    def __init__(self, url: str, opened: set[str], asked: dict[str, float]):
        self.url, self._opened, self._asked = url, opened, asked

    def open(self) -> None:
        self._opened.add(self._path)

    def last_asked(self) -> float | None:
        """time.time() of the last request, None before the first."""
        return self._asked.get(self._path)

    @property
    def _path(self) -> str:
        return self.url.rsplit("/", 1)[1]


def gate_step(gate: Gate) -> dict:
    """Holds the task Running until the test opens `gate`."""
    wait = ("import time, urllib.request\nwhile True:\n    try:\n"
            f"        urllib.request.urlopen({gate.url!r}, timeout=2)\n        break\n"
            "    except Exception:\n        time.sleep(0.2)")
    return {"name": "gate", "exec": {"command": ["python3", "-c", wait]}, "idempotent": True, "timeoutSeconds": 120}


def beat_until_killed(gate: Gate) -> list[str]:
    """A step's command that asks `gate` every 0.2 s until it is killed (its last beat is when it
    stopped, within 0.2 s and a request)."""
    beat = ("import time, urllib.request\nwhile True:\n    try:\n"
            f"        urllib.request.urlopen({gate.url!r}, timeout=1)\n"
            "    except Exception:\n        pass\n    time.sleep(0.2)")
    return ["python3", "-c", beat]


def ask_once(gate: Gate) -> list[str]:
    """A step's command that asks `gate` once (when it ran, on this host's clock)."""
    return ["python3", "-c", f"import urllib.request\ntry:\n    urllib.request.urlopen({gate.url!r}, timeout=5)\n"
                             "except Exception:\n    pass"]


def exit_until_open(gate: Gate, code: int) -> list[str]:
    """A step's command that exits `code` while `gate` is closed and 0 once it is open."""
    check = (f"import sys, urllib.request\ntry:\n    urllib.request.urlopen({gate.url!r}, timeout=2)\n"
             f"except Exception:\n    sys.exit({code})")
    return ["python3", "-c", check]


def sleep_until_open(gate: Gate) -> list[str]:
    """A step's command that ends at once if `gate` is open, else sleeps two minutes."""
    return ["python3", "-c", f"import time, urllib.request\ntry:\n    urllib.request.urlopen({gate.url!r}, timeout=2)\n"
                             "except Exception:\n    time.sleep(120)"]


@contextmanager
def served_gates(host: str) -> Iterator[Callable[[bool], Gate]]:
    """Makes gates, closed when made unless `opened_now`."""
    opened: set[str] = set()
    asked: dict[str, float] = {}

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            asked[self.path.strip("/")] = time.time()
            self.send_response(200 if self.path.strip("/") in opened else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def gate(opened_now: bool) -> Gate:
        made = Gate(f"http://{host}:{server.server_address[1]}/{uuid.uuid4().hex}", opened, asked)
        if opened_now:
            made.open()
        return made

    try:
        yield gate
    finally:
        server.shutdown()
