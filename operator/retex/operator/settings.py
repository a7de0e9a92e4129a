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
        )
