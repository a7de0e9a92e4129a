"""`retex-operator`: the Runtime on every replica, kopf only on the elected leader.

Every replica runs the Runtime (ledger, lease watch, ledger listener, the workers' ledger
endpoint, metrics, the election; the writer loops run their rounds only while it leads). kopf
runs only while this replica leads: it starts when the replica becomes leader (its watch lists
every Task: resume handlers admit what the old leader left) and is stopped when the lease is
lost. A standby runs no kopf because kopf writes by itself (finalizers, annotations; see
retex.operator.handlers). SIGTERM/SIGINT stop kopf, then the Runtime, which releases the lease.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING

import kopf
from kopf._core.engines.peering import Identity  # the type of kopf.operator's identity, not re-exported

from retex.ledger import InstallMismatch
from retex.logs import JsonLines, log_line
from retex.operator.health import serve_health
from retex.operator.settings import OperatorSettings

if TYPE_CHECKING:  # imported in main(): the import registers kopf's handlers
    from retex.operator.handlers import Runtime

log = logging.getLogger(__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description="retex operator")
    parser.add_argument("--health", default=os.environ.get("RETEX_HEALTH", "http://0.0.0.0:8080"),
                        help="where to serve /readyz and /livez (the probes); empty to serve none")
    parser.add_argument("--namespace", action="append",
                        help="watch only these namespaces (repeatable; default: RETEX_NAMESPACES, "
                             "comma-separated, else all)")
    args = parser.parse_args()
    args.namespace = args.namespace or [ns for ns in os.environ.get("RETEX_NAMESPACES", "").split(",") if ns]
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    from retex.operator import taskpolicies  # noqa: F401  registers its handlers
    from retex.operator.handlers import Runtime  # registers the handlers

    settings = OperatorSettings.from_env()
    try:
        runtime = Runtime(settings, namespaces=args.namespace)
    except InstallMismatch as refused:  # a second install pointed at this ledger: nothing was written
        log_line(log, logging.ERROR, "not starting: the ledger belongs to another install", why=str(refused))
        raise SystemExit(1) from None
    runtime.start(settings.metrics_port, settings.ledger_port, settings.ledger_tls)
    health = serve_health(args.health, ready=runtime.ready, live=runtime.live) if args.health else None
    try:
        asyncio.run(_operate(runtime, namespaces=args.namespace))
    finally:
        runtime.stop()
        if health is not None:
            health.shutdown()


async def _operate(runtime: Runtime, *, namespaces: list[str]) -> None:
    """Run kopf for each term this replica leads, until a signal."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signals() -> None:  # kopf installs its own while it runs; ours again after each term
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, stopping.set)

    on_signals()
    recheck = runtime.leadership.timing.retry_period / 2
    while not stopping.is_set():
        if not runtime.may_write():
            await _sleep_unless(stopping, recheck)
            continue
        term_over = asyncio.Event()
        term = asyncio.create_task(kopf.operator(
            clusterwide=not namespaces, namespaces=namespaces,
            standalone=True,  # no kopf peering: the leader election decides who runs kopf
            # kopf would name itself after the account, and the image's uid has none (KeyError).
            identity=Identity(runtime.leadership.identity),
            stop_flag=term_over, memo=kopf.Memo(runtime=runtime)))
        while runtime.may_write() and not stopping.is_set() and not term.done():
            await _sleep_unless(stopping, recheck)
        if term.done() and not term_over.is_set():
            stopping.set()  # kopf ended by itself (a signal it caught, or an error): so do we
        term_over.set()
        await term
        on_signals()
        if not stopping.is_set():
            log_line(log, logging.INFO, "leader election: kopf stopped (this replica no longer leads)")


async def _sleep_unless(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout=seconds)
    except TimeoutError:
        pass


if __name__ == "__main__":
    main()
