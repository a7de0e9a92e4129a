"""The helm CLI for the chart's tests (charts/retex): built from its Go module by e2e/rig/build.sh
into the same versioned cache as the rig's control plane, and run with the rig's kubeconfig."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from e2e.rig.controlplane import GOBUILD, REPO, say

CHART = REPO / "charts" / "retex"
# `helm template` knows no cluster: what helm finds on an API server of Kubernetes 1.36 or later
# (the rig's and kind's are 1.37), for the templates that ask (charts/retex/templates/task-finalizer-policy.yaml).
SERVES_MUTATING_POLICIES = ("--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")


def _pinned_version() -> str:
    for line in (GOBUILD / "helm" / "go.mod").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[:2] == ["require", "helm.sh/helm/v4"]:
            return parts[2]
    raise RuntimeError(f"helm.sh/helm/v4 not pinned in {GOBUILD / 'helm' / 'go.mod'}")


def helm_binary(build: bool = True) -> Path:
    """The pinned helm; builds it (and any missing rig binary) if the cache lacks it."""
    cache = Path(os.environ.get("RETEX_CACHE", Path.home() / ".cache" / "retex")) / "bin"
    path = cache / f"helm-{_pinned_version()}" / "helm"
    if build and not path.is_file():
        say("helm missing: building it (progress follows)")
        subprocess.run(["bash", str(REPO / "e2e" / "rig" / "build.sh"), "helm"], check=True)
    return path


def run_helm(*args: str, kubeconfig: Path | None = None, check: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess:
    """helm with its own config, cache and data under the kubeconfig's directory (or a temp one),
    so no test reads or writes the user's ~/.config/helm."""
    home = Path(kubeconfig).parent / "helm" if kubeconfig else Path(os.environ.get("TMPDIR", "/tmp")) / "retex-helm"
    env = os.environ | {f"HELM_{kind}_HOME": str(home / kind.lower()) for kind in ("CONFIG", "CACHE", "DATA")}
    cmd = [str(helm_binary()), *args] + ([f"--kubeconfig={kubeconfig}"] if kubeconfig else [])
    result = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, cmd, result.stdout, result.stderr)
    return result


def template(*value_args: str, namespace: str = "retex-system", include_crds: bool = False) -> list[dict]:
    """The chart's objects as `helm template` renders them for a release in `namespace`."""
    args = ["template", "retex", str(CHART), "--namespace", namespace, *value_args]
    rendered = run_helm(*args, *(["--include-crds"] if include_crds else [])).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]
