"""pytest fixtures for the local rig (loaded by tests/conftest.py as a plugin).

`rig` (session scope) starts the cluster the first time a test asks for it and stops it at the
end of the session. With RETEX_KUBECONFIG set, it uses that existing cluster instead (this is how
the same scenarios run on kind, e2e/rig/external.py); the nemeses it lacks raise RigUnavailable.

Environment knobs:
    RETEX_KUBECONFIG      use this cluster, start nothing
    RETEX_KIND_CLUSTER    ... which is this kind cluster: nodes are lost by `docker kill`
    RETEX_POD_HOST        ... whose pods reach this host at this address (default 127.0.0.1)
    RETEX_WORKER_IMAGE    ... whose workers run this image (default retex-worker:dev)
    RETEX_RIG_STATE_DIR   state directory of the rig (default: a fresh /tmp/retex-rig-XXXX)
    RETEX_RIG_KEEP=1      keep the state directory (logs, pod output) after the session
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from e2e.rig.controlplane import Rig, say, sweep_orphans
from e2e.rig.external import from_environment


@pytest.fixture(scope="session")
def rig(request):
    """The local cluster (e2e.rig.controlplane.Rig), or ExternalCluster under RETEX_KUBECONFIG."""
    external = from_environment()
    if external is not None:
        yield external
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
