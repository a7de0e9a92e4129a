"""`make dev` / `make down`: all of retex running locally, on the local rig, in one command.

    python -m e2e.dev up        rig, Postgres, CRD + RBAC, counting stub, operator, examples
    python -m e2e.dev operator  restart only the operator, with the RETEX_* settings of this shell
    python -m e2e.dev down      stop everything `up` started (recorded PIDs only), keep the logs

RETEX_DEV_CLUSTER=kind (at `up`) uses a kind cluster instead of the rig: e2e/kind/up.sh creates it
and deploys retex from images built here (manifests/overlays/dev, its in-cluster Postgres); the
stub runs on this host where the pods reach it (the kind network's gateway); `operator` sets the
shell's RETEX_* on the operator's Deployment (a rollout); `down` deletes the cluster.

RETEX_* variables of the shell that runs `up` or `operator` (RETEX_MAX_RUNNING, ...; docs/operator.md)
reach the operator and win over the rig's own defaults.

Everything lives in one state directory, /tmp/retex-dev (or $RETEX_DEV_DIR):
`rig/` (the local control plane: kubeconfig, component and pod logs), `postgres/`, `pids/`,
`operator.log`, `stub.log`, `stub-state.json`, `operator.kubeconfig`, `dev.json`.

The operator runs as a local process (the rig has no images) but with the credentials it has on a
real cluster: a token of the `retex-operator` ServiceAccount, bound to the ClusterRole of
manifests/base (applied through manifests/overlays/local). Worker pods run as `retex-worker`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from e2e.postgres import PostgresServer, free_port
from e2e.rig import pki as pkilib
from e2e.rig import procs
from e2e.rig.controlplane import Rig, run_kubectl, wait_for
from e2e.system import OperatorProcess, default_task_policy, prepare_namespace, wait_established

REPO = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("RETEX_DEV_DIR", "/tmp/retex-dev"))
LOCAL_OVERLAY = REPO / "manifests" / "overlays" / "local"
EXAMPLES = REPO / "examples"
EXAMPLE_FILES = ("order-fulfilment.yaml", "exec-pipeline.yaml", "delayed-reminder.yaml", "dead-letter.yaml")
EXAMPLES_NAMESPACE = "retex-examples"
OPERATOR_NAMESPACE, OPERATOR_ACCOUNT = "retex-system", "retex-operator"
STUB_PORT = 18089  # the examples' URLs name it
EXAMPLES_STUB = f"127.0.0.1:{STUB_PORT}"  # where the examples' URLs point: the rig's pods share this host's loopback
DELAY_SECONDS = 45  # the delayed example's notBefore, from now
CLUSTERS = ("rig", "kind")  # RETEX_DEV_CLUSTER
# Its own name, not RETEX_KIND_CLUSTER: up.sh first deletes a cluster of that name, and that one
# may be a kept e2e cluster the shell points its tests at. `make e2e-kind` names its own.
KIND_CLUSTER = os.environ.get("RETEX_DEV_KIND_CLUSTER") or "retex-dev"
# The shell's settings that are make dev's (and make e2e-kind's) own, not the operator's.
DEV_SETTINGS = ("RETEX_DEV_", "RETEX_KIND_")
OPERATOR_SETTINGS = REPO / "operator" / "retex" / "operator" / "settings.py"
# On kind the operator's wiring comes from the overlay (the DSN Secret, the ledger endpoint and
# its certificate, ports, images, the election's namespace): only its tunables come from the shell.
DEPLOYED_WIRING = ("RETEX_DATABASE_", "RETEX_LEDGER_URL", "RETEX_LEDGER_PORT", "RETEX_LEDGER_TLS_", "RETEX_LEDGER_CA_",
                   "RETEX_METRICS_PORT", "RETEX_OPERATOR_NAMESPACE", "RETEX_WORKER_IMAGE", "RETEX_WORKER_SERVICE_ACCOUNT")
# The stub's port, opened to the examples' workers on kind (manifests/tenant's NetworkPolicy lets
# them reach only DNS, the ledger and 443/6443; kindest/node's kindnet enforces it).
STUB_EGRESS = "retex-dev-stub-egress"


def say(message: str) -> None:
    print(f"[dev {time.strftime('%H:%M:%S')}] {message}", flush=True)


def service_account_kubeconfig(kubectl, admin_kubeconfig: Path, namespace: str, account: str, path: Path,
                               duration: str = "24h") -> Path:
    """A kubeconfig that authenticates as a ServiceAccount (a TokenRequest via `kubectl create
    token`), on the admin kubeconfig's cluster: RBAC applies to whoever uses it."""
    token = kubectl("create", "token", account, "-n", namespace, f"--duration={duration}").stdout.strip()
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    user = f"system:serviceaccount:{namespace}:{account}"
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "cluster", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "cluster", "user": user}}],
        "current-context": user,
    }
    path.touch(mode=0o600)
    path.write_text(yaml.safe_dump(config))
    return path


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def _delayed(manifest: str, seconds: int) -> str:
    task = yaml.safe_load(manifest)
    not_before = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
    task["spec"]["notBefore"] = not_before.strftime("%Y-%m-%dT%H:%M:%SZ")
    return yaml.safe_dump(task)


def install_missing_tools() -> None:
    """What the rig and Postgres need from the OS (the Makefile already made .venv and the
    control-plane binaries). As root, apt-get installs what is missing, as .ci/run does."""
    if shutil.which("kubectl") is None:
        raise SystemExit("kubectl is missing: install it (https://kubernetes.io/docs/tasks/tools/)")
    needed = {"postgresql": not glob.glob("/usr/lib/postgresql/*/bin/postgres") and not shutil.which("postgres"),
              "openssl": shutil.which("openssl") is None,
              "util-linux": os.geteuid() == 0 and shutil.which("setpriv") is None}
    missing = [package for package, absent in needed.items() if absent]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit(f"missing: {' '.join(missing)} (e.g. sudo apt-get install {' '.join(missing)})")
    say(f"[0/7] installing {' '.join(missing)} with apt-get")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def up(state: Path) -> int:
    cluster = os.environ.get("RETEX_DEV_CLUSTER") or "rig"
    if cluster not in CLUSTERS:
        raise SystemExit(f"RETEX_DEV_CLUSTER={cluster}: expected one of {', '.join(CLUSTERS)}")
    return up_on_kind(state) if cluster == "kind" else up_on_rig(state)


def up_on_rig(state: Path) -> int:
    started = time.monotonic()
    install_missing_tools()
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o755)  # Postgres runs as nobody and pods as other users: they traverse it
    pids = state / "pids"
    if any(procs.recorded_pid(record) for record in pids.glob("*")):
        say(f"a previous `make dev` in {state} is still running: stopping it first")
        down(state)
    # A fresh rig means a fresh ledger and fresh stub counts: nothing from a previous run is kept.
    shutil.rmtree(state / "postgres", ignore_errors=True)
    (state / "stub-state.json").unlink(missing_ok=True)

    say("[1/7] starting the local rig (etcd, kube-apiserver, controller manager, scheduler, 2 nodes)")
    rig = Rig(state / "rig")
    rig.up()
    kubectl = rig.kubectl

    say("[2/7] starting Postgres (the ledger)")
    postgres = PostgresServer(state / "postgres", free_port())
    postgres.start()
    procs.record(pids / "postgres", postgres.proc.pid)
    subprocess.run([str(postgres.bindir / "createdb"), "-h", "127.0.0.1", "-p", str(postgres.port),
                    "-U", "retex_admin", "retex"], check=True)
    dsn = postgres.dsn(dbname="retex")

    say("[3/7] installing the CRD and the operator's RBAC (kubectl apply -k manifests/overlays/local)")
    kubectl("apply", "--server-side", "--force-conflicts", "-k", str(LOCAL_OVERLAY))
    wait_established(kubectl, "tasks.retex.dev")
    say(f"      tenant namespace {EXAMPLES_NAMESPACE}: onboarded (manifests/tenant), no credentials; its")
    say("      TaskPolicy is the default one (manifests/tenant/task-policy-default.yaml) plus the custom worker's image")
    prepare_namespace(kubectl, EXAMPLES_NAMESPACE, task_policy=default_task_policy(images=["shop-worker:"]))

    say(f"[4/7] starting the counting stub on 127.0.0.1:{STUB_PORT} (the http examples' endpoint)")
    if not _port_free(STUB_PORT):
        raise SystemExit(f"port {STUB_PORT} is in use; the examples need it for the stub")
    procs.spawn([sys.executable, "-m", "e2e.stub", "--port", str(STUB_PORT), "--state", str(state / "stub-state.json")],
                pids / "stub", state / "stub.log", cwd=REPO)
    wait_for("the stub", lambda: not _port_free(STUB_PORT), timeout=15)

    say(f"[5/7] starting the operator as ServiceAccount {OPERATOR_NAMESPACE}/{OPERATOR_ACCOUNT} (log: {state / 'operator.log'})")
    operator_kubeconfig = service_account_kubeconfig(kubectl, rig.kubeconfig, OPERATOR_NAMESPACE, OPERATOR_ACCOUNT,
                                                     state / "operator.kubeconfig")
    operator = _operator(state, operator_kubeconfig, dsn)
    operator.start()
    procs.record(pids / "operator", operator.proc.pid)
    (state / "dev.json").write_text(json.dumps({
        "kubeconfig": str(rig.kubeconfig), "operator_kubeconfig": str(operator_kubeconfig), "dsn": dsn,
        "stub": f"http://127.0.0.1:{STUB_PORT}",
        "operator_ports": {"ledger": operator.ledger_port, "metrics": operator.metrics_port,
                           "health": operator.health_port}}, indent=2) + "\n")

    say(f"[6/7] applying examples/ in namespace {EXAMPLES_NAMESPACE}")
    _apply_examples(kubectl, EXAMPLES_STUB)

    say("[7/7] waiting for the operator to accept every example")

    def operator_alive() -> None:
        if operator.exited() is not None:
            raise SystemExit(f"the operator exited ({operator.exited()}):\n{operator.log_tail()}")

    _wait_accepted(kubectl, operator_alive)
    say(f"up in {time.monotonic() - started:.0f}s")
    print(f"""
retex is running on the local rig. Next:
{_tour(rig.kubeconfig, EXAMPLES_STUB)}
logs:   operator {state / 'operator.log'}, stub {state / 'stub.log'},
        worker pods {state / 'rig'}/nodes/<node>/pods/<namespace>_<pod>_<uid>/worker.log
ledger: psql "{dsn}"
operator settings: RETEX_MAX_RUNNING=2 make dev-operator   # restarts only the operator with them
stop:   make down
""")
    return 0


def _tour(kubeconfig: Path, stub: str) -> str:
    """The commands `up` prints to try the examples, whichever cluster they run on."""
    return f"""
  export KUBECONFIG={kubeconfig}
  export PATH="{Path(sys.executable).parent}:$PATH"         # kubectl retex (the CLI plugin) and retex
  kubectl config set-context --current --namespace={EXAMPLES_NAMESPACE}
  kubectl get tasks.retex.dev -w                        # PHASE, PROGRESS, ATTEMPT as they change
  kubectl describe tasks.retex.dev order-1042           # conditions, steps, events
  kubectl wait --for=condition=Succeeded tasks.retex.dev/order-1042 --timeout=120s
  kubectl wait --for=condition=DeadLettered tasks.retex.dev/notify-partner --timeout=120s
  kubectl retex history order-1042                      # attempts and steps, as your kubeconfig's user
  curl -s {stub}/counts                        # real executions per idempotency key
  kubectl apply -f examples/exec-pipeline.yaml          # (after editing metadata.name) run more
"""


def _apply_examples(kubectl, stub: str) -> None:
    """examples/ into the examples namespace, their stub URLs pointed at `stub` (host:port)."""
    for name in EXAMPLE_FILES:
        manifest = (EXAMPLES / name).read_text().replace(EXAMPLES_STUB, stub)
        if name == "delayed-reminder.yaml":
            manifest = _delayed(manifest, DELAY_SECONDS)
            say(f"      {name} (notBefore set to {DELAY_SECONDS}s from now)")
        else:
            say(f"      {name}")
        kubectl("apply", "-n", EXAMPLES_NAMESPACE, "-f", "-", input=manifest)


def _wait_accepted(kubectl, operator_alive) -> None:
    """Until every example shows a phase; `operator_alive` raises when the operator is gone."""
    def all_accepted():
        operator_alive()
        tasks = json.loads(kubectl("get", "tasks.retex.dev", "-n", EXAMPLES_NAMESPACE, "-o", "json").stdout)["items"]
        waiting = [t["metadata"]["name"] for t in tasks if not (t.get("status") or {}).get("phase")]
        return (not waiting, f"not yet accepted: {', '.join(waiting)}")

    wait_for("the operator to accept the examples", all_accepted, timeout=120)
    print(kubectl("get", "tasks.retex.dev", "-n", EXAMPLES_NAMESPACE).stdout, end="")


def _operator_settings() -> dict[str, str]:
    """The shell's RETEX_* settings for the operator."""
    return {name: value for name, value in os.environ.items()
            if name.startswith("RETEX_") and not name.startswith(DEV_SETTINGS)}


def _operator(state: Path, kubeconfig: Path, dsn: str) -> OperatorProcess:
    """The dev operator: its TLS files in the state directory (kept across restarts, so running
    workers keep trusting it), the shell's RETEX_* settings over the rig's defaults."""
    settings = _operator_settings()
    # Dev rig only: a Task annotated retex.dev/failpoint=<point>[:<step>] crashes its first worker
    # there (the tour's crash demo; the crash matrix's switch). Never set on a real cluster.
    return OperatorProcess(kubeconfig, dsn, state / "operator.log",
                           extra_env={"RETEX_FAILPOINTS_FROM_ANNOTATIONS": "1", **settings},
                           ledger_tls=_ledger_tls(state))


def _ledger_tls(state: Path) -> pkilib.Pki:
    directory = state / "operator-ledger-tls"
    return pkilib.Pki(directory) if (directory / "ca.crt").exists() else pkilib.ledger_serving(directory)


def restart_operator(state: Path) -> int:
    """Only the operator again, on the same ports (running workers keep reaching it), with the
    RETEX_* settings of this shell."""
    try:
        dev = json.loads((state / "dev.json").read_text())
    except FileNotFoundError:
        raise SystemExit(f"no `make dev` in {state}: run `make dev` first") from None
    if dev.get("cluster") == "kind":
        _configure_deployed_operator(state)
        return 0
    pids = state / "pids"
    if procs.stop(pids / "operator", grace=20, sig=signal.SIGTERM):
        say("stopped the operator")
    operator = _operator(state, Path(dev["operator_kubeconfig"]), dev["dsn"])
    ports = dev["operator_ports"]
    operator.ledger_port, operator.metrics_port, operator.health_port = ports["ledger"], ports["metrics"], ports["health"]
    operator.start()
    procs.record(pids / "operator", operator.proc.pid)
    given = sorted(name for name in operator.extra_env if name != "RETEX_FAILPOINTS_FROM_ANNOTATIONS")
    say(f"operator started again (pid {operator.proc.pid}, log {state / 'operator.log'})"
        + (f" with {', '.join(f'{name}={os.environ[name]}' for name in given)}" if given else ""))
    started = time.monotonic()
    def ready():
        if operator.exited() is not None:
            raise SystemExit(f"the operator exited ({operator.exited()}):\n{operator.log_tail()}")
        try:
            return operator.probe("/readyz")[0] == 200
        except OSError:  # not listening yet
            return False

    wait_for("the operator to be ready", ready, timeout=60)
    say(f"the operator is ready after {time.monotonic() - started:.0f}s")
    return 0


def down(state: Path) -> int:
    pids = state / "pids"
    dev_json = state / "dev.json"
    dev = json.loads(dev_json.read_text()) if dev_json.exists() else {}
    if dev.get("cluster") == "kind":
        if procs.stop(pids / "stub", grace=20, sig=signal.SIGTERM):
            say("stopped the stub")
        subprocess.run([_kind(), "delete", "cluster", "--name", dev["kind_cluster"]], check=True)
        dev_json.unlink()
        say(f"deleted kind cluster {dev['kind_cluster']}; the stub's log stays in {state}")
        return 0
    for name, sig in (("operator", signal.SIGTERM), ("stub", signal.SIGTERM)):
        if procs.stop(pids / name, grace=20, sig=sig):
            say(f"stopped the {name}")
    if (state / "rig" / "rig.json").exists():
        Rig.load(state / "rig").down()  # agents first (their pods die with them), etcd last
        say("stopped the rig")
    # SIGINT is Postgres' fast shutdown: it does not wait for clients to disconnect.
    if procs.stop(pids / "postgres", grace=30, sig=signal.SIGINT):
        say("stopped Postgres")
    say(f"everything `make dev` started is stopped; logs stay in {state} until the next `make dev`")
    return 0


def up_on_kind(state: Path) -> int:
    """`make dev` on kind: the cluster and retex deployed from images built here (e2e/kind/up.sh),
    the stub on this host where the pods reach it, the examples."""
    started = time.monotonic()
    state.mkdir(parents=True, exist_ok=True)
    if (state / "dev.json").exists():
        say(f"a previous `make dev` in {state}: stopping it first")
        down(state)
    (state / "stub-state.json").unlink(missing_ok=True)
    if shutil.which("kubectl") is None:
        raise SystemExit("kubectl is missing: install it (https://kubernetes.io/docs/tasks/tools/)")
    say("[1/5] a Docker engine (images/docker-engine.sh: starts one where none answers)")
    subprocess.run(["bash", str(REPO / "images" / "docker-engine.sh")], check=True)
    say(f"[2/5] kind cluster {KIND_CLUSTER} with retex deployed from images built here (e2e/kind/up.sh)")
    kubeconfig = state / "kubeconfig"
    # Before the cluster exists: a failure part way leaves `make down` what it needs to delete it.
    (state / "dev.json").write_text(json.dumps({"cluster": "kind", "kind_cluster": KIND_CLUSTER,
                                                "kubeconfig": str(kubeconfig)}, indent=2) + "\n")
    subprocess.run(["bash", str(REPO / "e2e" / "kind" / "up.sh"), KIND_CLUSTER, str(kubeconfig), str(state / "kind")],
                   check=True)
    _configure_deployed_operator(state)

    def kubectl(*args, **kwargs):
        return run_kubectl(kubeconfig, *args, **kwargs)

    host = _kind_gateway()
    dev = json.loads((state / "dev.json").read_text())
    (state / "dev.json").write_text(json.dumps({**dev, "pod_host": host}, indent=2) + "\n")  # for e2e/kind/run.sh
    kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": STUB_EGRESS, "namespace": EXAMPLES_NAMESPACE},
        "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}, "policyTypes": ["Egress"],
                 "egress": [{"to": [{"ipBlock": {"cidr": f"{host}/32"}}], "ports": [{"protocol": "TCP", "port": STUB_PORT}]}]}}))
    say(f"[3/5] starting the counting stub on {host}:{STUB_PORT}, where the pods reach this host")
    if not _port_free(STUB_PORT, host):
        raise SystemExit(f"port {STUB_PORT} is in use on {host}; the examples need it for the stub")
    procs.spawn([sys.executable, "-m", "e2e.stub", "--host", host, "--port", str(STUB_PORT),
                 "--state", str(state / "stub-state.json")], state / "pids" / "stub", state / "stub.log", cwd=REPO)
    wait_for("the stub", lambda: not _port_free(STUB_PORT, host), timeout=15)

    say(f"[4/5] applying examples/ in namespace {EXAMPLES_NAMESPACE} (their stub URLs pointed at {host}:{STUB_PORT})")
    _apply_examples(kubectl, f"{host}:{STUB_PORT}")
    say("[5/5] waiting for the operator to accept every example")
    _wait_accepted(kubectl, lambda: None)
    say(f"up in {time.monotonic() - started:.0f}s")
    print(f"""
retex is running on kind cluster {KIND_CLUSTER}, deployed from the images built here. Next:
{_tour(kubeconfig, f"{host}:{STUB_PORT}")}
logs:   kubectl logs -n retex-system deploy/retex-operator; worker pods: kubectl logs -n {EXAMPLES_NAMESPACE} <pod>
ledger: kubectl exec -it -n retex-system statefulset/retex-postgres -- psql -U retex retex
operator settings: RETEX_MAX_RUNNING=2 make dev-operator   # sets them on the Deployment (a rollout)
stop:   make down                                     # deletes the cluster
""")
    return 0


def _configure_deployed_operator(state: Path) -> None:
    """The shell's tunables (RETEX_* that retex/operator/settings.py reads, not the overlay's
    wiring) on the deployed operator, exactly: one set before and not now is removed, as the rig's
    restart drops it. On this dev cluster only, a Task's failpoint annotation is honoured (the
    tour's crash demo). A rollout when they change."""
    dev = json.loads((state / "dev.json").read_text())
    kubeconfig = Path(dev["kubeconfig"])
    known = set(re.findall(r"RETEX_[A-Z0-9_]+", OPERATOR_SETTINGS.read_text()))
    given = _operator_settings()
    tunables = {name: value for name, value in given.items()
                if (name in known or name.startswith("RETEX_LEADER_")) and not name.startswith(DEPLOYED_WIRING)}
    if ignored := sorted(set(given) - set(tunables)):
        say(f"not set on the deployed operator (the overlay's wiring, or not an operator setting): {', '.join(ignored)}")
    settings = {"RETEX_FAILPOINTS_FROM_ANNOTATIONS": "1", **tunables}
    dropped = sorted(set(dev.get("operator_settings", [])) - set(settings))
    run_kubectl(kubeconfig, "set", "env", "-n", OPERATOR_NAMESPACE, "deployment/retex-operator",
                *(f"{name}={value}" for name, value in sorted(settings.items())), *(f"{name}-" for name in dropped))
    (state / "dev.json").write_text(json.dumps({**dev, "operator_settings": sorted(settings)}, indent=2) + "\n")
    say("operator settings: " + ", ".join(f"{name}={value}" for name, value in sorted(settings.items()))
        + (f"; removed {', '.join(dropped)}" if dropped else ""))
    run_kubectl(kubeconfig, "rollout", "status", "-n", OPERATOR_NAMESPACE, "deployment/retex-operator",
                "--timeout=180s", timeout=200)
    say("the operator is rolled out")


def _kind() -> str:
    """The kind that e2e/kind/build-node.sh built (e2e/kind/kind-path.sh names it)."""
    return subprocess.run(["bash", str(REPO / "e2e" / "kind" / "kind-path.sh")], check=True, capture_output=True,
                          text=True).stdout.strip()


def _kind_gateway() -> str:
    """This host's address on the kind network: where the pods reach it."""
    gateways = subprocess.run(["docker", "network", "inspect", "kind", "-f",
                               "{{range .IPAM.Config}}{{if .Gateway}}{{.Gateway}} {{end}}{{end}}"],
                              check=True, capture_output=True, text=True).stdout.split()
    ipv4 = [gateway for gateway in gateways if gateway.count(".") == 3]
    if not ipv4:
        raise SystemExit(f"the docker network `kind` has no IPv4 gateway ({gateways}): the pods cannot reach the stub")
    return ipv4[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "operator", "down"])
    parser.add_argument("--state-dir", type=Path, default=STATE_DIR)
    args = parser.parse_args()
    return {"up": up, "operator": restart_operator, "down": down}[args.command](args.state_dir.resolve())


if __name__ == "__main__":
    sys.exit(main())
