"""pytest fixtures for the local rig (loaded by tests/conftest.py as a plugin).

`rig` (session scope) starts the cluster the first time a test asks for it and stops it at the
end of the session. With RETEX_KUBECONFIG set, it uses that existing cluster instead (this is how
the same scenarios run on kind); the nemeses then raise RigUnavailable.

Environment knobs:
    RETEX_KUBECONFIG      use this cluster, start nothing
    RETEX_RIG_STATE_DIR   state directory of the rig (default: a fresh /tmp/retex-rig-XXXX)
    RETEX_RIG_KEEP=1      keep the state directory (logs, pod output) after the session
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from e2e.rig.controlplane import Rig, RigError, create_namespace, run_kubectl, say, sweep_orphans


class RigUnavailable(RigError):
    """A nemesis was asked of an external cluster (RETEX_KUBECONFIG): only the rig has them."""


class ExternalCluster:
    """The `rig` interface over an existing cluster: clients yes, nemeses no."""

    def __init__(self, kubeconfig: Path):
        self.kubeconfig = kubeconfig
        self.state_dir = None
        from kubernetes import client

        with self.api_client() as api:
            self.nodes = [n.metadata.name for n in client.CoreV1Api(api).list_node().items]

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return run_kubectl(self.kubeconfig, *args, input=input, check=check, timeout=timeout)

    def create_namespace(self, name: str) -> None:
        with self.api_client() as api:
            create_namespace(api, name)

    def _unavailable(self, what: str):
        raise RigUnavailable(f"{what} needs the local rig; RETEX_KUBECONFIG={self.kubeconfig} "
                             "is an external cluster")

    def kill_node(self, node: str) -> None:
        self._unavailable("kill_node")

    def restart_node(self, node: str, wait: bool = True) -> None:
        self._unavailable("restart_node")

    def pause_pod(self, namespace: str, name: str) -> None:
        self._unavailable("pause_pod")

    def resume_pod(self, namespace: str, name: str) -> None:
        self._unavailable("resume_pod")

    def restart_apiserver(self, hard: bool = False) -> None:
        self._unavailable("restart_apiserver")

    def restart_etcd(self, hard: bool = False) -> None:
        self._unavailable("restart_etcd")

    def restart_controller_manager(self) -> None:
        self._unavailable("restart_controller_manager")

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        args = ["logs", "-n", namespace, name] + (["-c", container] if container else [])
        return self.kubectl(*args).stdout


@pytest.fixture(scope="session")
def rig(request):
    """The local cluster (e2e.rig.controlplane.Rig), or ExternalCluster under RETEX_KUBECONFIG."""
    external = os.environ.get("RETEX_KUBECONFIG")
    if external:
        yield ExternalCluster(Path(external))
        return
    # Start-up and teardown progress goes to the terminal, not into pytest's captured output:
    # nobody should stare at a silent terminal while the rig (or a cold build) starts.
    uncaptured = request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled
    state_dir = os.environ.get("RETEX_RIG_STATE_DIR") or tempfile.mkdtemp(prefix="retex-rig-")
    cluster = Rig(Path(state_dir))
    try:
        with uncaptured():
            sweep_orphans()
            cluster.up(owner_pid=os.getpid())
        yield cluster
    finally:
        with uncaptured():
            cluster.down()
            if os.environ.get("RETEX_RIG_KEEP"):
                say(f"rig stopped; state kept in {cluster.state_dir}")
            else:
                shutil.rmtree(cluster.state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def kubeconfig(rig) -> Path:
    """Path of an admin kubeconfig for the session's cluster."""
    return rig.kubeconfig


@pytest.fixture(scope="session")
def kube(rig):
    """A kubernetes.client.ApiClient for the admin user of the session's cluster."""
    with rig.api_client() as api:
        yield api
