"""The worker's settings, all from the environment the operator's Job sets."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_DRAIN_SECONDS = 25.0  # inside Kubernetes' default 30 s termination grace period
LEDGER_RETRY_SECONDS = 60.0  # how long the ledger may be unreachable before the attempt is given up
# Where the Job's projected volume puts the pod's token for the ledger endpoint (retex.kube.objects).
DEFAULT_LEDGER_TOKEN_FILE = "/var/run/secrets/retex/ledger-token"


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class WorkerConfig:
    task_uid: str
    namespace: str
    name: str
    epoch: int
    spec_hash: str  # of the Task's spec the Job was built from
    lease_name: str
    lease_duration_seconds: int
    ledger_url: str  # the operator's ledger endpoint; workers hold no database credentials
    ledger_ca: str | None  # PEM: the CA of the endpoint's certificate (https); None: the system's
    ledger_token_file: str
    pod_name: str
    node_name: str | None
    drain_seconds: float

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerConfig:
        def required(var: str) -> str:
            value = environ.get(var, "")
            if not value:
                raise ConfigError(f"{var} is not set")
            return value

        def integer(var: str) -> int:
            try:
                return int(required(var))
            except ValueError:
                raise ConfigError(f"{var} must be an integer, not {environ[var]!r}") from None

        return cls(
            task_uid=required("RETEX_TASK_UID"),
            namespace=required("RETEX_TASK_NAMESPACE"),
            name=required("RETEX_TASK_NAME"),
            epoch=integer("RETEX_EPOCH"),
            spec_hash=required("RETEX_SPEC_HASH"),
            lease_name=required("RETEX_LEASE_NAME"),
            lease_duration_seconds=integer("RETEX_LEASE_DURATION_SECONDS"),
            ledger_url=required("RETEX_LEDGER_URL"),
            ledger_ca=environ.get("RETEX_LEDGER_CA") or None,
            ledger_token_file=environ.get("RETEX_LEDGER_TOKEN_FILE") or DEFAULT_LEDGER_TOKEN_FILE,
            # A pod's hostname is its name; POD_NAME (downward API) is the explicit form.
            pod_name=environ.get("POD_NAME") or socket.gethostname(),
            node_name=environ.get("NODE_NAME") or None,
            drain_seconds=float(environ.get("RETEX_DRAIN_SECONDS") or DEFAULT_DRAIN_SECONDS),
        )
