"""Operator settings, from the environment (the Deployment sets them)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from retex.kube.election import ElectionTiming
from retex.kube.objects import WorkerDefaults


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
    history_retention_days: float | None = None  # purge terminal tasks this long after they end
    worker_start_deadline_seconds: float = 120.0  # dispatch → lease taken, else a failed attempt
    dispatch_defer_limit_seconds: float = 600.0  # first transient dispatch error → the task fails
    metrics_port: int | None = 9090  # RETEX_METRICS_PORT; empty or 0: no metrics endpoint
    ledger_port: int = 8081  # RETEX_LEDGER_PORT: the workers' ledger endpoint (RETEX_LEDGER_URL reaches it)
    # Leader election among replicas: RETEX_LEADER_{LEASE,RENEW_DEADLINE,RETRY}_SECONDS, on the
    # Lease retex-operator-leader in RETEX_OPERATOR_NAMESPACE (the Deployment's own namespace).
    leader_election: ElectionTiming = ElectionTiming()
    operator_namespace: str = "retex-system"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        env = dict(os.environ if env is None else env)
        try:
            database_url = env["RETEX_DATABASE_URL"]
        except KeyError:
            raise SystemExit("RETEX_DATABASE_URL is not set (the ledger's Postgres DSN)") from None
        ledger_port = _number(env, "RETEX_LEDGER_PORT", int) or 8081
        return cls(
            database_url=database_url,
            ledger_port=ledger_port,
            worker=WorkerDefaults(
                image=env.get("RETEX_WORKER_IMAGE", "retex-worker:latest"),
                service_account=env.get("RETEX_WORKER_SERVICE_ACCOUNT", "retex-worker"),
                ledger_url=env.get("RETEX_LEDGER_URL", f"http://retex-ledger.retex-system.svc:{ledger_port}"),
                termination_grace_seconds=_number(env, "RETEX_WORKER_GRACE_SECONDS", int) or 30,
            ),
            resync_seconds=_number(env, "RETEX_RESYNC_SECONDS", float) or 30.0,
            failpoints_from_annotations=env.get("RETEX_FAILPOINTS_FROM_ANNOTATIONS") == "1",
            max_running=_number(env, "RETEX_MAX_RUNNING", int),
            max_running_per_namespace=_number(env, "RETEX_MAX_RUNNING_PER_NAMESPACE", int),
            history_retention_days=_number(env, "RETEX_HISTORY_RETENTION_DAYS", float),
            worker_start_deadline_seconds=_number(env, "RETEX_WORKER_START_DEADLINE_SECONDS", float) or 120.0,
            dispatch_defer_limit_seconds=_number(env, "RETEX_DISPATCH_DEFER_LIMIT_SECONDS", float) or 600.0,
            metrics_port=_metrics_port(env),
            leader_election=_election_timing(env),
            operator_namespace=env.get("RETEX_OPERATOR_NAMESPACE", "").strip() or "retex-system",
        )


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


def _metrics_port(env: dict[str, str]) -> int | None:
    """9090 when unset; empty or 0 turns the endpoint off."""
    if env.get("RETEX_METRICS_PORT", "9090").strip() in ("", "0"):
        return None
    return _number(env, "RETEX_METRICS_PORT", int) or 9090


def _number(env: dict[str, str], name: str, kind: type):
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
