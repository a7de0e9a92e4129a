"""The operator's health endpoint (RETEX_HEALTH / --health, default http://0.0.0.0:8080), served on
every replica, leader or standby (kopf runs only on the leader, so kopf's own probes would not):

    /readyz  200 while this replica should get the workers' ledger calls (the retex-ledger Service
             sends them to ready replicas only): Postgres answers, every background thread lives,
             the ledger endpoint serves, and, on the leader, it has not waited a lease duration
             for the ledger's leadership term and every writer loop completed a round within
             three of its periods. A standby's writer loops are idle by design.
    /livez   200 unless a restart is the cure: a thread died, or a round of a loop has run far
             longer than anything it waits on can take (10 periods + the wedge floor, which
             exceeds the ledger's retry window). Postgres is not asked: an outage must not
             become a restart storm.
    /healthz the same as /livez (what the probes used before /readyz and /livez).

A failing answer's body names the reason. The decisions (`readiness`, `liveness`) are pure."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

STALE_AFTER_PERIODS = 3
WEDGED_AFTER_PERIODS = 10
# A writer loop whose period is tiny (the status mirror's 0.1 s) still gets this long per round
# before a leader counts as stale: a round may write many statuses.
MIN_STALE_SECONDS = 15.0


@dataclass(frozen=True)
class LoopState:
    """What the probes know of one writer loop (retex.operator.loop.Loop), monotonic seconds."""

    name: str
    period: float
    round_started_at: float | None  # None between rounds
    last_pass_at: float  # a completed round, or a standby's idle check


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


OK = Verdict(True, "ok")


def liveness(*, dead_threads: list[str], loops: list[LoopState], now: float, wedge_floor: float) -> Verdict:
    if dead_threads:
        return Verdict(False, f"thread(s) dead: {', '.join(dead_threads)}")
    for loop in loops:
        if loop.round_started_at is None:
            continue
        running_for = now - loop.round_started_at
        if running_for > WEDGED_AFTER_PERIODS * loop.period + wedge_floor:
            return Verdict(False, f"loop {loop.name} wedged: its round has run for {running_for:.0f}s")
    return OK


def term_overdue(waiting_for_term: float | None, *, lease_duration: float) -> bool:
    """Whether a leader has waited too long for the ledger's leadership term (Postgres away from
    it, or an old leader's long transaction holding the term's row): a lease duration. Its writer
    loops idle meanwhile, as a standby's do, so it is not ready and gives the Lease up
    (retex.operator.leadership), for a standby that can take the term to lead.
    `waiting_for_term`: seconds it has led without the term (None: it holds it, or does not lead)."""
    return waiting_for_term is not None and waiting_for_term >= lease_duration


def readiness(*, postgres_error: str | None, dead_threads: list[str], endpoint_serving: bool,
              leading: bool, loops: list[LoopState], now: float, waiting_for_term: float | None,
              lease_duration: float) -> Verdict:
    if postgres_error is not None:
        return Verdict(False, f"postgres unreachable: {postgres_error}")
    if dead_threads:
        return Verdict(False, f"thread(s) dead: {', '.join(dead_threads)}")
    if not endpoint_serving:
        return Verdict(False, "the ledger endpoint's server thread is dead")
    if leading and waiting_for_term is not None and term_overdue(waiting_for_term, lease_duration=lease_duration):
        return Verdict(False, f"leading without the ledger's leadership term for {waiting_for_term:.0f}s "
                              f"(limit {lease_duration:g}s)")
    if leading:
        for loop in loops:
            stale_after = max(STALE_AFTER_PERIODS * loop.period, MIN_STALE_SECONDS)
            if now - loop.last_pass_at > stale_after:
                return Verdict(False, f"loop {loop.name} has completed no round for {now - loop.last_pass_at:.0f}s "
                                      f"(leader; limit {stale_after:.0f}s)")
    return OK


def serve_health(url: str, *, ready: Callable[[], Verdict], live: Callable[[], Verdict]) -> ThreadingHTTPServer:
    where = urlparse(url)
    answers = {"/readyz": ready, "/livez": live, "/healthz": live}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            decide = answers.get(self.path)
            if decide is None:
                self.send_error(404)
                return
            verdict = decide()
            body = f"{verdict.reason}\n".encode()
            self.send_response(200 if verdict.ok else 503)
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
