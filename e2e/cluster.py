"""The local rig from the command line (used by `make dev`):

    python -m e2e.cluster up [--state-dir D]      start etcd, the control plane and two node agents
    python -m e2e.cluster status [--state-dir D]  show every component and the nodes
    python -m e2e.cluster down [--state-dir D]    stop everything the rig started

The state directory defaults to $RETEX_RIG_STATE_DIR or /tmp/retex-rig-dev.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from e2e.rig.controlplane import Rig, RigError

DEFAULT_STATE_DIR = Path(os.environ.get("RETEX_RIG_STATE_DIR", "/tmp/retex-rig-dev"))


def _existing(state_dir: Path) -> Rig | None:
    return Rig.load(state_dir) if (state_dir / "rig.json").exists() else None


def up(state_dir: Path) -> int:
    existing = _existing(state_dir)
    if existing is not None and existing.running():
        print(f"the rig in {state_dir} is already running")
    else:
        rig = Rig(state_dir)
        try:
            rig.up()
        except BaseException:
            rig.down()  # no half-started rig left behind; the logs stay in the state directory
            print(f"rig start failed; component logs are in {state_dir}/logs", file=sys.stderr)
            raise
    rig = Rig.load(state_dir)
    print(f"""
kubeconfig: {rig.kubeconfig}
nodes:      {', '.join(rig.nodes)}

next steps:
  export KUBECONFIG={rig.kubeconfig}
  kubectl get nodes
  python -m e2e.cluster status --state-dir {state_dir}
  python -m e2e.cluster down --state-dir {state_dir}
pod output: {state_dir}/nodes/<node>/pods/<namespace>_<pod>_<uid>/<container>.log
component logs: {state_dir}/logs/""")
    return 0


def status(state_dir: Path) -> int:
    rig = _existing(state_dir)
    if rig is None:
        print(f"no rig in {state_dir}")
        return 1
    rows = rig.status()
    for component, pid, health in rows:
        print(f"{component:28} {'pid ' + str(pid) if pid else '-':12} {health}")
    if any(component == "kube-apiserver" and health == "healthy" for component, _, health in rows):
        print()
        print(rig.kubectl("get", "nodes", "-o", "wide", check=False).stdout, end="")
    print(f"\nkubeconfig: {rig.kubeconfig}")
    return 0 if all(pid for _, pid, _ in rows) else 1


def down(state_dir: Path) -> int:
    rig = _existing(state_dir)
    if rig is None:
        print(f"no rig in {state_dir}")
        return 0
    rig.down()
    print(f"rig in {state_dir} stopped (state directory kept; delete it to discard logs)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    args = parser.parse_args(argv)
    state_dir = args.state_dir.resolve()
    try:
        return {"up": up, "down": down, "status": status}[args.command](state_dir)
    except RigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
