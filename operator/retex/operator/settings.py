"""Operator settings, from the environment (the Deployment sets them)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from typing import TypeVar

from retex.kube.election import ElectionTiming
from retex.kube.objects import WorkerDefaults
from retex.ledger import SessionLimits
from retex.ledger.tls import unverified_tls_refusal
from retex.logs import log_line
from retex.operator.ledger_endpoint import LedgerTls

log = logging.getLogger(__name__)
LEDGER_INSECURE_FLAG = "RETEX_LEDGER_INSECURE"
N = TypeVar("N", int, float)
_LEDGER_TLS_FILES = ("RETEX_LEDGER_TLS_CERT_FILE", "RETEX_LEDGER_TLS_KEY_FILE", "RETEX_LEDGER_CA_FILE")


@dataclass(frozen=True)
class OperatorSettings:
    database_url: str
    worker: WorkerDefaults
    resync_seconds: float = 30.0  # full status resync, for anything NOTIFY missed
    reaper_interval_seconds: float = 1.0
    relay_interval_seconds: float = 2.0
    failpoints_from_annotations: bool = False  # test rigs only: see retex.kube.objects
    max_running: int | None = None  # running attempts in all; None: unlimited
    max_running_per_namespace: int | None = None
    # Finished tasks are purged this long after they end (None: kept for ever, RETEX_HISTORY_RETENTION_DAYS=off).
    history_retention_days: float | None = 7.0
    # What one namespace may keep in the ledger, judged at admission (docs/ledger.md, "Retention and quotas").
    namespace_max_tasks: int = 100_000
    namespace_max_result_bytes: int = 2**30
    worker_start_deadline_seconds: float = 120.0  # dispatch → lease taken, else a failed attempt
    dispatch_defer_limit_seconds: float = 600.0  # first transient dispatch error → the task fails
    metrics_port: int | None = 9090  # RETEX_METRICS_PORT; empty or 0: no metrics endpoint
    ledger_port: int = 8081  # RETEX_LEDGER_PORT: the workers' ledger endpoint (RETEX_LEDGER_URL reaches it)
    # The liveness probe's allowance for one round beyond 10 periods: above the ledger's retry
    # window (120 s) plus API timeouts, so a Postgres outage never reads as a wedged loop.
    loop_wedge_floor_seconds: float = 180.0
    ledger_tls: LedgerTls | None = None  # None: plain HTTP, only with RETEX_LEDGER_INSECURE=1
    # Leader election among replicas: RETEX_LEADER_{LEASE,RENEW_DEADLINE,RETRY}_SECONDS, on the
    # Lease retex-operator-leader in RETEX_OPERATOR_NAMESPACE (the Deployment's own namespace).
    leader_election: ElectionTiming = ElectionTiming()
    operator_namespace: str = "retex-system"
    # RETEX_ADOPT_LEDGER: the install uid of the ledger's owner that this install replaces (retex
    # reinstalled with its old database); unset, an operator refuses a ledger another install owns.
    adopt_ledger: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        env = dict(os.environ if env is None else env)
        try:
            database_url = env["RETEX_DATABASE_URL"]
        except KeyError:
            raise SystemExit("RETEX_DATABASE_URL is not set (the ledger's Postgres DSN)") from None
        refusal = unverified_tls_refusal(database_url, env)
        if refusal:
            raise SystemExit(f"RETEX_DATABASE_URL: {refusal}")
        ledger_port = _number(env, "RETEX_LEDGER_PORT", int) or 8081
        ledger_tls = _ledger_tls(env)
        scheme = "https" if ledger_tls else "http"
        ledger_url = env.get("RETEX_LEDGER_URL", f"{scheme}://retex-ledger.retex-system.svc:{ledger_port}")
        if ledger_tls and not ledger_url.startswith("https://"):
            raise SystemExit(f"RETEX_LEDGER_URL={ledger_url!r}: the ledger endpoint serves TLS, so workers reach "
                             "it at an https:// address")
        return cls(
            database_url=database_url,
            ledger_port=ledger_port,
            ledger_tls=ledger_tls,
            worker=WorkerDefaults(
                image=env.get("RETEX_WORKER_IMAGE", "retex-worker:latest"),
                service_account=env.get("RETEX_WORKER_SERVICE_ACCOUNT", "retex-worker"),
                ledger_url=ledger_url,
                ledger_ca=_read_ca(ledger_tls),
                termination_grace_seconds=_number(env, "RETEX_WORKER_GRACE_SECONDS", int) or 30,
            ),
            resync_seconds=_number(env, "RETEX_RESYNC_SECONDS", float) or 30.0,
            failpoints_from_annotations=env.get("RETEX_FAILPOINTS_FROM_ANNOTATIONS") == "1",
            max_running=_number(env, "RETEX_MAX_RUNNING", int),
            max_running_per_namespace=_number(env, "RETEX_MAX_RUNNING_PER_NAMESPACE", int),
            history_retention_days=_retention_days(env),
            namespace_max_tasks=_number(env, "RETEX_NAMESPACE_MAX_TASKS", int) or 100_000,
            namespace_max_result_bytes=_number(env, "RETEX_NAMESPACE_MAX_RESULT_BYTES", int) or 2**30,
            worker_start_deadline_seconds=_number(env, "RETEX_WORKER_START_DEADLINE_SECONDS", float) or 120.0,
            dispatch_defer_limit_seconds=_number(env, "RETEX_DISPATCH_DEFER_LIMIT_SECONDS", float) or 600.0,
            loop_wedge_floor_seconds=_number(env, "RETEX_LOOP_WEDGE_FLOOR_SECONDS", float) or 180.0,
            metrics_port=_metrics_port(env),
            leader_election=_election_timing(env),
            operator_namespace=env.get("RETEX_OPERATOR_NAMESPACE", "").strip() or "retex-system",
            adopt_ledger=env.get("RETEX_ADOPT_LEDGER", "").strip() or None,
        )


class LiveWorkerDefaults:
    """The WorkerDefaults a Job is built with now: the ledger CA is read again at every call (a
    small file), so a rotation that changes the CA reaches the next Jobs without an operator
    restart. A CA file that cannot be read leaves the last one read."""

    def __init__(self, start: WorkerDefaults, tls: LedgerTls | None):
        self._current, self._tls = start, tls

    def __call__(self) -> WorkerDefaults:
        if self._tls is None:
            return self._current
        try:
            pem = self._tls.ca_pem()
        except OSError as exc:
            log_line(log, logging.WARNING, "ledger CA not read again, the last one stays", error=str(exc))
            return self._current
        if pem.strip() and pem != self._current.ledger_ca:
            self._current = replace(self._current, ledger_ca=pem)
        return self._current


def _ledger_tls(env: dict[str, str]) -> LedgerTls | None:
    """The endpoint's certificate files: all three, or none and the insecure flag."""
    given = {name: env.get(name, "").strip() for name in _LEDGER_TLS_FILES}
    if all(given.values()):
        missing = [f"{name}={path}" for name, path in given.items() if not os.path.isfile(path)]
        if missing:
            raise SystemExit(f"the ledger endpoint's TLS files are not readable: {', '.join(missing)}")
        return LedgerTls(*given.values())
    if any(given.values()):
        raise SystemExit(f"the ledger endpoint's TLS needs all of {', '.join(_LEDGER_TLS_FILES)}; "
                         f"unset: {', '.join(name for name, path in given.items() if not path)}")
    if env.get(LEDGER_INSECURE_FLAG) == "1":
        return None
    raise SystemExit(f"the ledger endpoint serves workers' pod tokens: it needs TLS. Set {', '.join(_LEDGER_TLS_FILES)} "
                     "(a kubernetes.io/tls Secret with ca.crt, mounted; docs/install.md), or "
                     f"{LEDGER_INSECURE_FLAG}=1 to serve plain HTTP (development only).")


def _read_ca(tls: LedgerTls | None) -> str | None:
    return tls.ca_pem() if tls else None


def session_limits(timing: ElectionTiming) -> SessionLimits:
    """The operator's ledger sessions (the leader's writes and the workers' endpoint), from the
    election's timing: a transaction idle for the renew deadline R is ended by the server, and a
    statement that waited R for a lock is cancelled. A replica frozen inside a transaction has
    stopped leading by then, and its locks are free within about 2 R of the freeze (its successor
    starts at D > R: it waits for them only when D < 2 R)."""
    return SessionLimits(idle_in_transaction_seconds=timing.renew_deadline, lock_timeout_seconds=timing.renew_deadline)


def _election_timing(env: dict[str, str]) -> ElectionTiming:
    default = ElectionTiming()
    try:
        return ElectionTiming(
            lease_duration=_number(env, "RETEX_LEADER_LEASE_SECONDS", float) or default.lease_duration,
            renew_deadline=_number(env, "RETEX_LEADER_RENEW_DEADLINE_SECONDS", float) or default.renew_deadline,
            retry_period=_number(env, "RETEX_LEADER_RETRY_SECONDS", float) or default.retry_period,
        )
    except ValueError as refused:
        raise SystemExit(str(refused)) from None


def _retention_days(env: dict[str, str]) -> float | None:
    """7 when unset; `off`: finished tasks are kept for ever. 0 is refused rather than read as
    off or as "purge at once": either reading would surprise someone."""
    value = env.get("RETEX_HISTORY_RETENTION_DAYS", "").strip()
    if not value:
        return 7.0
    if value.lower() == "off":
        return None
    try:
        days = float(value)
    except ValueError:
        days = math.nan
    if not math.isfinite(days) or days <= 0:
        raise SystemExit(f"RETEX_HISTORY_RETENTION_DAYS={value!r}: give a positive number of days (finished tasks "
                         "are purged that long after they end; default 7), or off to keep them for ever")
    return days


def _metrics_port(env: dict[str, str]) -> int | None:
    """9090 when unset; empty or 0 turns the endpoint off."""
    if env.get("RETEX_METRICS_PORT", "9090").strip() in ("", "0"):
        return None
    return _number(env, "RETEX_METRICS_PORT", int) or 9090


def _number(env: dict[str, str], name: str, kind: type[N]) -> N | None:
    """The variable as a positive number; None when unset or empty (the caller's default)."""
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        parsed = kind(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r} is not a number") from None
    if not math.isfinite(parsed) or parsed <= 0:
        raise SystemExit(f"{name} must be positive (unset it for the default)")
    if name.endswith("_PORT") and parsed > 65535:
        raise SystemExit(f"{name}={value!r} is not a port (1 to 65535)")
    return parsed
