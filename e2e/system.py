"""retex itself on a cluster, for scenarios: the CRD, a tenant namespace with the worker's RBAC,
and the operator as a local process that tests can kill and restart.

Used by the cluster tests, the crash-matrix suite and `make dev`; the same calls work against the
local rig or (through RETEX_KUBECONFIG) an external cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import yaml

from e2e.postgres import free_port
from e2e.rig.controlplane import wait_for as rig_wait_for

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "tasks.retex.dev.yaml"
WORKER_RBAC = REPO / "manifests" / "base" / "worker-rbac.yaml"
LEADER_ELECTION_FOR_TESTS = {"RETEX_LEADER_LEASE_SECONDS": "4", "RETEX_LEADER_RENEW_DEADLINE_SECONDS": "3",
                             "RETEX_LEADER_RETRY_SECONDS": "0.5"}


def install_crd(kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/tasks.retex.dev")


def prepare_namespace(kubectl, namespace: str) -> None:
    """A namespace where Tasks may run: the worker ServiceAccount and its Role. No credentials:
    workers reach the ledger through the operator's endpoint with their own pod's token."""
    manifest = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    kubectl("apply", "-f", "-", input=json.dumps(manifest))
    kubectl("apply", "-n", namespace, "-f", str(WORKER_RBAC))


class OperatorProcess:
    """`retex-operator` as a child process with its own log file."""

    def __init__(self, kubeconfig: Path, dsn: str, log_path: Path, *, extra_env: dict[str, str] | None = None):
        self.kubeconfig, self.dsn, self.log_path = kubeconfig, dsn, log_path
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen | None = None
        self.metrics_port = free_port()
        self.ledger_port = free_port()

    def start(self, **env: str) -> None:
        environment = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "RETEX_DATABASE_URL": self.dsn,
            "RETEX_WORKER_IMAGE": "retex-worker:local",
            # Pods on the rig are processes on this host; on kind, the operator's Service name.
            "RETEX_LEDGER_PORT": str(self.ledger_port),
            "RETEX_LEDGER_URL": f"http://127.0.0.1:{self.ledger_port}",
            "RETEX_WORKER_GRACE_SECONDS": "10",
            "RETEX_RESYNC_SECONDS": "5",
            "RETEX_METRICS_PORT": str(self.metrics_port),
            # Leader election: a killed operator's successor (a new identity) waits out the lease
            # duration, so tests that restart operators keep it short.
            **LEADER_ELECTION_FOR_TESTS,
            **self.extra_env,
            **env,
        }
        # The election Lease lives in the operator's namespace: a scoped operator's (its test's own
        # namespace, so tests never share an election), else retex-system as deployed.
        scoped = [ns for ns in environment.get("RETEX_NAMESPACES", "").split(",") if ns]
        environment.setdefault("RETEX_OPERATOR_NAMESPACE", scoped[0] if scoped else "retex-system")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "retex-operator"), "--liveness", ""],
            env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def kill(self) -> None:
        """kill -9: the operator gets no chance to tidy up."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self, **env: str) -> None:
        self.kill()
        self.start(**env)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def task_manifest(name: str, steps: list[dict[str, Any]], **spec: Any) -> str:
    return yaml.safe_dump({"apiVersion": "retex.dev/v1alpha1", "kind": "Task", "metadata": {"name": name},
                           "spec": {"steps": steps, **spec}})


def wait_for(predicate, *, timeout: float, interval: float = 0.25, what: str = "condition"):
    """The rig's poller (progress every few seconds, RigError on timeout) with the keyword order
    scenarios read best in."""
    return rig_wait_for(what, predicate, timeout, interval=interval)


@dataclass(frozen=True)
class PodEnd:
    pod: str
    exit_code: int | None  # None while it runs
    log: str


def job_pod_ends(rig, namespace: str, job: str) -> list[PodEnd]:
    """How each pod of `job` ended (exit code and output), from the rig's node agents' records:
    kept after the pod and its Job are deleted (the reaper deletes a replaced attempt's Job)."""
    ends = []
    for node in rig.nodes:
        agent_log = (rig.state_dir / "logs" / f"agent-{node}.log").read_text(errors="replace")
        for pod_dir in sorted((rig.node_dir(node) / "pods").glob(f"{namespace}_{job}-*")):
            pod = pod_dir.name.split("_")[1]
            codes = re.findall(rf"pod {re.escape(namespace)}/{re.escape(pod)} container \S+ exited with (\d+)",
                               agent_log)
            log = "".join(p.read_text(errors="replace") for p in sorted(pod_dir.glob("*.log")))
            ends.append(PodEnd(pod, int(codes[-1]) if codes else None, log))
    return ends
