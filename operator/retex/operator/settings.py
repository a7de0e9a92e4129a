"""Operator settings, from the environment (the Deployment sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass

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

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        env = dict(os.environ if env is None else env)
        try:
            database_url = env["RETEX_DATABASE_URL"]
        except KeyError:
            raise SystemExit("RETEX_DATABASE_URL is not set (the ledger's Postgres DSN)") from None
        return cls(
            database_url=database_url,
            worker=WorkerDefaults(
                image=env.get("RETEX_WORKER_IMAGE", "retex-worker:latest"),
                service_account=env.get("RETEX_WORKER_SERVICE_ACCOUNT", "retex-worker"),
                database_secret=env.get("RETEX_WORKER_DATABASE_SECRET", "retex-worker-db"),
                termination_grace_seconds=int(env.get("RETEX_WORKER_GRACE_SECONDS", "30")),
            ),
            resync_seconds=float(env.get("RETEX_RESYNC_SECONDS", "30")),
            failpoints_from_annotations=env.get("RETEX_FAILPOINTS_FROM_ANNOTATIONS") == "1",
            max_running=_optional(env, "RETEX_MAX_RUNNING", int),
            max_running_per_namespace=_optional(env, "RETEX_MAX_RUNNING_PER_NAMESPACE", int),
            history_retention_days=_optional(env, "RETEX_HISTORY_RETENTION_DAYS", float),
            worker_start_deadline_seconds=_optional(env, "RETEX_WORKER_START_DEADLINE_SECONDS", float) or 120.0,
            dispatch_defer_limit_seconds=_optional(env, "RETEX_DISPATCH_DEFER_LIMIT_SECONDS", float) or 600.0,
            metrics_port=int(env.get("RETEX_METRICS_PORT", "9090") or 0) or None,
        )


def _optional(env: dict[str, str], name: str, kind: type):
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        parsed = kind(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r} is not a number") from None
    if parsed <= 0:
        raise SystemExit(f"{name} must be positive (unset it for no limit)")
    return parsed
