"""A Service for processes on the rig: one local port forwarding each connection to the next of
several backends (round robin, skipping one that refuses the connection), as kube-proxy would to
a Service's pods. The rig has no kube-proxy; tests with two operators give the workers this one
ledger URL, so a worker's calls reach whichever replica is alive, as on a cluster.

`SlowAnswers` is the same forwarder to one backend, whose answers it holds back a given time: a
loaded API server as its clients see it."""

from __future__ import annotations

import itertools
import queue
import socket
import socketserver
import threading
import time


class _Forward(socketserver.BaseRequestHandler):
    server: RoundRobinService

    def handle(self) -> None:
        upstream = self.server.connect()
        if upstream is None:
            return
        with upstream:
            pipes = [threading.Thread(target=pipe, args=(self.request, upstream), daemon=True),
                     threading.Thread(target=self.server.answer, args=(upstream, self.request), daemon=True)]
            for copier in pipes:
                copier.start()
            for copier in pipes:
                copier.join()


def pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes from `source` to `sink` until either end closes, then shut both down."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        shut_down(source, sink)


def shut_down(*ends: socket.socket) -> None:
    for end in ends:
        try:
            end.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class RoundRobinService(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, backends: list[int], *, host: str = "127.0.0.1"):
        """`host`: where the cluster's pods reach this host (the rig's loopback; on kind, the kind
        network's gateway); the backends are this host's own ports."""
        super().__init__((host, 0), _Forward)
        self.host = host
        self._backends = backends
        self._next = itertools.cycle(range(len(backends)))
        self._lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.server_address[1]}"  # TLS end to end: bytes are forwarded

    def answer(self, upstream: socket.socket, client: socket.socket) -> None:
        pipe(upstream, client)

    def connect(self) -> socket.socket | None:
        for _ in self._backends:
            with self._lock:
                port = self._backends[next(self._next)]
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=2)
            except OSError:
                continue  # not listening (killed, not started yet): the next one
            upstream.settimeout(None)  # the timeout was for connecting; the callers time their calls
            return upstream
        return None

    def remove(self, port: int) -> None:
        """Send no new connection to `port` (what the endpoints controller does once a replica's
        readiness probe fails); connections already made stay as they are."""
        with self._lock:
            self._backends = [backend for backend in self._backends if backend != port]
            self._next = itertools.cycle(range(len(self._backends)))

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class SlowAnswers(RoundRobinService):
    """A forwarder to this host's `port` whose answers (bytes from it) each reach the client
    `delay` seconds after they left the backend; `delay` may change while connections are open.
    Requests go through at once, and TLS end to end, so a client keeps its server's name and CA."""

    def __init__(self, port: int, *, delay: float = 0.0):
        super().__init__([port])
        self.delay = delay

    def answer(self, upstream: socket.socket, client: socket.socket) -> None:
        held: queue.Queue[tuple[float, bytes]] = queue.Queue()  # (when to pass it on, bytes); b"" ends

        def read() -> None:
            try:
                while data := upstream.recv(65536):
                    held.put((time.monotonic() + self.delay, data))
            except OSError:
                pass
            held.put((time.monotonic() + self.delay, b""))

        threading.Thread(target=read, daemon=True).start()
        try:
            while True:
                due, data = held.get()
                time.sleep(max(0.0, due - time.monotonic()))
                if not data:
                    break
                client.sendall(data)
        except OSError:
            pass
        finally:
            shut_down(upstream, client)
