"""The local rig: real etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback,
plus process-based node agents (e2e.rig.agent), all under one state directory.

State directory layout (everything the rig writes lives here):
    rig.json                   ports, node names, timings: what `status`/`down`/nemeses need
    owner.pid                  record of the process that started the rig (orphan sweeping)
    pki/                       CA, serving and client certificates, service-account key pair
    kubeconfig                 admin (system:masters) kubeconfig: give it to kubectl
    kubeconfigs/               controller-manager and scheduler kubeconfigs
    etcd/                      etcd data
    logs/<component>.log       output of every component and agent
    pids/<component>.pid       process records (pid + start time), see e2e.rig.procs
    nodes/<node>/pods/<ns>_<name>_<uid>/   a pod's working directory, kubeconfig, logs, process records
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from e2e.ports import free_port
from e2e.rig import pki as pkilib
from e2e.rig import procs

REPO = Path(__file__).resolve().parents[2]
GOBUILD = REPO / "e2e" / "rig" / "gobuild"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")

# Exactly the controllers retex relies on; names as kube-controller-manager v1.37 spells them
# (the short forms like "job" are rejected).
CONTROLLERS = (
    "job-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
    "ttl-after-finished-controller",
    "resourcequota-controller",  # a ResourceQuota is enforced only once its usage is computed
)


def say(message: str) -> None:
    """Progress for humans: the rig never leaves a silent terminal during a long wait."""
    print(f"[rig] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Timing:
    """The knobs that decide how fast node loss is noticed (see docs/contributing/testing.md)."""

    node_monitor_period: str = "1s"
    node_monitor_grace_period: str = "10s"  # no heartbeat for this long -> node Ready=Unknown
    toleration_seconds: int = 5  # default not-ready/unreachable NoExecute toleration of pods
    lease_renew_seconds: float = 2.0  # node agents renew their Lease this often
    status_heartbeat_seconds: float = 4.0  # and refresh their Ready condition this often


class RigError(RuntimeError):
    pass


def _go_mod_version(module_dir: str, module: str) -> str:
    for line in (GOBUILD / module_dir / "go.mod").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "require" and parts[1] == module:
            return parts[2]
    raise RigError(f"{module} not pinned in {GOBUILD / module_dir / 'go.mod'}")


def binaries(build: bool = True) -> dict[str, Path]:
    """Paths of the control-plane binaries; builds them (e2e/rig/build.sh) if the cache lacks them."""
    cache = Path(os.environ.get("RETEX_CACHE", Path.home() / ".cache" / "retex")) / "bin"
    k8s = cache / f"kubernetes-{_go_mod_version('kubernetes', 'k8s.io/kubernetes')}"
    etcd = cache / f"etcd-{_go_mod_version('etcd', 'go.etcd.io/etcd/server/v3')}"
    paths = {"etcd": etcd / "etcd"} | {name: k8s / name for name in CONTROL_PLANE[1:]}
    if build and not all(p.is_file() for p in paths.values()):
        say("control-plane binaries missing: building them (progress follows)")
        subprocess.run(["bash", str(REPO / "e2e" / "rig" / "build.sh"), "etcd", "kubernetes"], check=True)
    return paths


def wait_for(what: str, check, timeout: float, *, interval: float = 0.2, abort=None):
    """Call `check()` until it returns a truthy value, printing progress every few seconds.

    `check` may return (value, detail) to say what it still waits for; connection errors count
    as "not yet". `abort()` may return a message to give up early (e.g. the process died).
    """
    started = time.monotonic()
    last_report = started
    detail = ""
    while True:
        message = abort() if abort is not None else None
        if message:
            raise RigError(message)
        try:
            result = check()
        except (OSError, ssl.SSLError) as e:
            result, detail = None, f"{type(e).__name__}: {e}"
        if isinstance(result, tuple):
            result, detail = result
        if result:
            return result
        elapsed = time.monotonic() - started
        if elapsed > timeout:
            raise RigError(f"timed out after {timeout:.0f}s waiting for {what} ({detail})")
        if time.monotonic() - last_report >= 3:
            say(f"waiting for {what} ({elapsed:.0f}s){': ' + str(detail) if detail else ''}")
            last_report = time.monotonic()
        time.sleep(interval)


def create_namespace(api_client, name: str, timeout: float = 30) -> None:
    """Create a namespace and wait for its `default` service account: pods created before the
    service-account controller made it are refused by the ServiceAccount admission plugin."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    core.create_namespace({"metadata": {"name": name}})

    def has_default():
        try:
            return bool(core.read_namespaced_service_account("default", name))
        except client.ApiException as e:
            return False, e.reason
    wait_for(f"service account {name}/default", has_default, timeout)


@dataclasses.dataclass(frozen=True)
class PodEnd:
    pod: str
    exit_code: int | None  # None while it runs
    log: str


class Rig:
    """One local cluster. `up()` starts it, `down()` stops it; the nemeses act on its processes."""

    # Pods are processes on this host: they reach the host's services (the operator's ledger
    # endpoint, the tests' stubs) on the loopback, and run the installed project for this image.
    pod_host = "127.0.0.1"
    worker_image = "retex-worker:local"
    cluster_type = "rig"  # what ran a benchmark (e2e/bench.py): rig, kind or external

    def __init__(self, state_dir: Path, nodes: tuple[str, ...] = ("rig-node-1", "rig-node-2"),
                 timing: Timing | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.nodes = list(nodes)
        self.timing = timing or Timing()
        self.ports: dict[str, int] = {}
        # agent thread → its CPUs and niceness before confine_nodes
        self._node_masks: dict[int, tuple[set[int], int]] = {}

    # ----- paths -------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def pki(self) -> pkilib.Pki:
        return pkilib.Pki(self.state_dir / "pki")

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def _record(self, component: str) -> Path:
        return self.state_dir / "pids" / f"{component}.pid"

    def _log(self, component: str) -> Path:
        return self.state_dir / "logs" / f"{component}.log"

    def node_dir(self, node: str) -> Path:
        return self.state_dir / "nodes" / node

    def pod_ends(self, namespace: str, job: str) -> list[PodEnd]:
        """How each pod of `job` ended (exit code and output), from the node agents' records:
        kept after the pod and its Job are deleted (the reaper deletes a replaced attempt's Job)."""
        ends = []
        for node in self.nodes:
            agent_log = self._log(f"agent-{node}").read_text(errors="replace")
            for pod_dir in sorted((self.node_dir(node) / "pods").glob(f"{namespace}_{job}-*")):
                pod = pod_dir.name.split("_")[1]
                codes = re.findall(rf"pod {re.escape(namespace)}/{re.escape(pod)} container \S+ exited with (\d+)",
                                   agent_log)
                log = "".join(p.read_text(errors="replace") for p in sorted(pod_dir.glob("*.log")))
                ends.append(PodEnd(pod, int(codes[-1]) if codes else None, log))
        return ends

    # ----- persistence -------------------------------------------------------------------------

    def _save(self) -> None:
        data = {"ports": self.ports, "nodes": self.nodes, "timing": dataclasses.asdict(self.timing)}
        (self.state_dir / "rig.json").write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, state_dir: Path) -> Rig:
        """The rig described by an existing state directory (for `status`, `down`, nemeses)."""
        data = json.loads((Path(state_dir) / "rig.json").read_text())
        rig = cls(state_dir, tuple(data["nodes"]), Timing(**data["timing"]))
        rig.ports = data["ports"]
        return rig

    # ----- lifecycle ---------------------------------------------------------------------------

    def up(self, owner_pid: int | None = None) -> None:
        """Start a fresh cluster in the state directory (cleaning up whatever a crashed run left).

        With `owner_pid`, the rig counts as orphaned once that process is gone: the next test
        session's `sweep_orphans()` stops it. The CLI's rig has no owner and lives until `down`.
        """
        started = time.monotonic()
        bins = binaries()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.kill_recorded_processes():
            say(f"cleaned up the processes of a previous run in {self.state_dir}")
        for child in self.state_dir.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        # Pods may run as other users (runAsUser): they must be able to traverse to their dirs.
        self.state_dir.chmod(0o755)
        if owner_pid is not None:
            procs.record(self.state_dir / "owner.pid", owner_pid)
        say(f"state directory {self.state_dir}")

        pkilib.create(self.pki.dir)
        for attempt in (1, 2):
            try:
                self._start_control_plane(bins)
                break
            except RigError as e:
                # Ports are free when chosen, but another process may bind one before we do.
                if attempt == 2 or "address already in use" not in str(e):
                    raise
                say("a port was taken in the meantime: starting again on fresh ports")
                self.kill_recorded_processes()
                shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)
        for node in self.nodes:
            self.start_node(node)
        self.wait_nodes_ready(self.nodes)
        self._wait_default_service_account()
        say(f"rig is up in {time.monotonic() - started:.1f}s: kubeconfig {self.kubeconfig}")

    def _start_control_plane(self, bins: dict[str, Path]) -> None:
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler")
        self.ports = dict(zip(names, [free_port() for _ in names], strict=True))
        self._save()
        self._write_kubeconfigs()
        self._start_etcd(bins)
        self._wait_etcd()
        self._start_apiserver(bins)
        self._wait_apiserver()
        self._start_controller_manager(bins)
        self._start_scheduler(bins)
        self._wait_component("kube-controller-manager", self.ports["controller-manager"])
        self._wait_component("kube-scheduler", self.ports["scheduler"])

    def down(self) -> None:
        """Stop every process the rig started (agents and pods first, etcd last)."""
        self.kill_recorded_processes()
        (self.state_dir / "owner.pid").unlink(missing_ok=True)

    def kill_recorded_processes(self) -> bool:
        """Stop all recorded processes of this state directory; True if any was still running."""
        found = False
        # Agents first: the API server's shutdown would otherwise wait on their watches.
        nodes = set(self.nodes) | {d.name for d in (self.state_dir / "nodes").glob("*")}
        for node in sorted(nodes):
            found |= self._kill_node_processes(node)
        for component in reversed(CONTROL_PLANE):
            found |= procs.stop(self._record(component))
        for leftover in (self.state_dir / "pids").glob("*.pid"):
            found |= procs.stop(leftover)
        return found

    # ----- control plane -----------------------------------------------------------------------

    def _write_kubeconfigs(self) -> None:
        p = self.pki
        pkilib.write_kubeconfig(self.kubeconfig, self.server, p.ca_crt, user="admin",
                                client_crt=p.crt("admin"), client_key=p.key("admin"))
        for name in ("controller-manager", "scheduler"):
            pkilib.write_kubeconfig(self.state_dir / "kubeconfigs" / f"{name}.conf", self.server,
                                    p.ca_crt, user=name, client_crt=p.crt(name),
                                    client_key=p.key(name))

    def _spawn(self, component: str, argv: list[str], **kwargs) -> None:
        procs.spawn(argv, self._record(component), self._log(component), **kwargs)

    def _etcd_argv(self, bins: dict[str, Path]) -> list[str]:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        return [
            str(bins["etcd"]), "--name=rig", f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=rig={peer}",
            # Test data: survives a process crash (page cache), not a machine crash. Much faster.
            "--unsafe-no-fsync=true", "--log-level=warn",
        ]

    def _start_etcd(self, bins: dict[str, Path]) -> None:
        say("starting etcd")
        self._spawn("etcd", self._etcd_argv(bins))

    def _apiserver_argv(self, bins: dict[str, Path]) -> list[str]:
        p, t = self.pki, self.timing
        return [
            str(bins["kube-apiserver"]),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['apiserver']}",
            f"--tls-cert-file={p.crt('apiserver')}", f"--tls-private-key-file={p.key('apiserver')}",
            f"--client-ca-file={p.ca_crt}",
            f"--service-account-key-file={p.sa_pub}",
            f"--service-account-signing-key-file={p.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC",
            # The defaults already include ServiceAccount and DefaultTolerationSeconds; naming
            # them documents the dependency. NodeRestriction would confine the agents, which
            # authenticate as admin, so it stays off (it is not in the default set either).
            "--enable-admission-plugins=ServiceAccount,DefaultTolerationSeconds",
            "--disable-admission-plugins=NodeRestriction",
            f"--default-not-ready-toleration-seconds={t.toleration_seconds}",
            f"--default-unreachable-toleration-seconds={t.toleration_seconds}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--endpoint-reconciler-type=none",  # 127.0.0.1 is not a valid endpoint address
            "--allow-privileged=true",
            "--profiling=false",
        ]

    def _start_apiserver(self, bins: dict[str, Path]) -> None:
        say("starting kube-apiserver")
        self._spawn("kube-apiserver", self._apiserver_argv(bins))

    def _controller_manager_argv(self, bins: dict[str, Path]) -> list[str]:
        conf = self.state_dir / "kubeconfigs" / "controller-manager.conf"
        t = self.timing
        return [
            str(bins["kube-controller-manager"]),
            f"--kubeconfig={conf}", f"--authentication-kubeconfig={conf}",
            f"--authorization-kubeconfig={conf}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['controller-manager']}",
            "--leader-elect=false",
            # Each controller acts as its own service account, as in kubeadm clusters: the
            # bootstrap RBAC roles of the controllers are exercised for real.
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.pki.sa_key}",
            f"--root-ca-file={self.pki.ca_crt}",
            f"--controllers={','.join(CONTROLLERS)}",
            f"--node-monitor-period={t.node_monitor_period}",
            f"--node-monitor-grace-period={t.node_monitor_grace_period}",
            "--kube-api-qps=100", "--kube-api-burst=200",
        ]

    def _start_controller_manager(self, bins: dict[str, Path]) -> None:
        say("starting kube-controller-manager")
        self._spawn("kube-controller-manager", self._controller_manager_argv(bins))

    def _scheduler_argv(self, bins: dict[str, Path]) -> list[str]:
        conf = self.state_dir / "kubeconfigs" / "scheduler.conf"
        return [
            str(bins["kube-scheduler"]),
            f"--kubeconfig={conf}", f"--authentication-kubeconfig={conf}",
            f"--authorization-kubeconfig={conf}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['scheduler']}",
            "--leader-elect=false",
        ]

    def _start_scheduler(self, bins: dict[str, Path]) -> None:
        say("starting kube-scheduler")
        self._spawn("kube-scheduler", self._scheduler_argv(bins))

    # ----- readiness ---------------------------------------------------------------------------

    def _https(self, url: str, *, client_cert: bool, timeout: float = 3.0) -> tuple[int, str]:
        if client_cert:
            ctx = ssl.create_default_context(cafile=str(self.pki.ca_crt))
            ctx.load_cert_chain(str(self.pki.crt("admin")), str(self.pki.key("admin")))
        else:  # the controller manager and scheduler serve self-signed certificates
            ctx = ssl._create_unverified_context()
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def _poll(self, what: str, check, timeout: float, component: str | None = None):
        def died():
            if component is not None and procs.recorded_pid(self._record(component)) is None:
                return (f"{component} exited while waiting for {what}; "
                        f"last log lines:\n{self.log_tail(component)}")
            return None
        return wait_for(what, check, timeout, abort=died)

    def log_tail(self, component: str, lines: int = 20) -> str:
        try:
            return "\n".join(self._log(component).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _etcd_healthy(self) -> tuple[bool, str]:
        url = f"http://127.0.0.1:{self.ports['etcd']}/health"
        with urllib.request.urlopen(url, timeout=3) as resp:
            body = resp.read().decode()
        return '"health":"true"' in body, body.strip()

    def _wait_etcd(self, timeout: float = 60) -> None:
        self._poll("etcd /health", self._etcd_healthy, timeout, "etcd")

    def _apiserver_ready(self) -> tuple[bool, str]:
        status, body = self._https(f"{self.server}/readyz?verbose", client_cert=True)
        failing = [line for line in body.splitlines() if line.startswith("[-]")]
        return status == 200, ", ".join(failing)[:200] or f"HTTP {status}"

    def _wait_apiserver(self, timeout: float = 120) -> None:
        self._poll("kube-apiserver /readyz", self._apiserver_ready, timeout, "kube-apiserver")

    def _wait_component(self, component: str, port: int, timeout: float = 60) -> None:
        def healthy():
            status, body = self._https(f"https://127.0.0.1:{port}/healthz", client_cert=False)
            return status == 200, body.strip()[:200]
        self._poll(f"{component} /healthz", healthy, timeout, component)

    def wait_nodes_ready(self, nodes: list[str], timeout: float = 60) -> None:
        """Wait until each node is Ready with no not-ready/unreachable taint left on it."""
        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)

            def ready():
                waiting = []
                for node in nodes:
                    try:
                        obj = core.read_node(node)
                    except client.ApiException as e:
                        waiting.append(f"{node}: {e.reason}")
                        continue
                    conditions = {c.type: c.status for c in obj.status.conditions or []}
                    taints = [t.key for t in obj.spec.taints or []
                              if t.key.startswith("node.kubernetes.io/")]
                    if conditions.get("Ready") != "True" or taints:
                        waiting.append(f"{node}: Ready={conditions.get('Ready')} taints={taints}")
                return not waiting, "; ".join(waiting)

            self._poll(f"nodes {', '.join(nodes)} Ready", ready, timeout)

    def _wait_default_service_account(self, timeout: float = 60) -> None:
        """The service-account controller works once `default` exists in `default`."""
        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)

            def exists():
                try:
                    return bool(core.read_namespaced_service_account("default", "default"))
                except client.ApiException as e:
                    return False, e.reason
            self._poll("service account default/default", exists, timeout)

    def create_namespace(self, name: str) -> None:
        """Create namespace `name`, ready for pods (its default service account exists)."""
        with self.api_client() as api:
            create_namespace(api, name)

    # ----- node agents -------------------------------------------------------------------------

    def _agent_record(self, node: str) -> Path:
        return self._record(f"agent-{node}")

    def start_node(self, node: str) -> None:
        """Start the agent process of `node` (a fresh "kubelet" after a reboot)."""
        t = self.timing
        env = os.environ | {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self._spawn(f"agent-{node}", [
            sys.executable, "-m", "e2e.rig.agent", f"--node={node}",
            f"--kubeconfig={self.kubeconfig}", f"--state-dir={self.state_dir}",
            f"--lease-renew-seconds={t.lease_renew_seconds}",
            f"--status-heartbeat-seconds={t.status_heartbeat_seconds}",
        ], cwd=REPO, env=env)

    def confine_nodes(self, cpus: set[int], nodes: list[str] | None = None, *, niceness: int = 0) -> None:
        """Run the node agents (`nodes`, or all), and every pod they start from now on, on `cpus`
        only, at `niceness` (benchmarks: as if the pods ran on machines apart from the control
        plane's) until `release_nodes`. Each thread of an agent is set, since a pod inherits the
        mask and the niceness of the thread that spawned it; the main thread first, so a thread it
        starts meanwhile is found by the next listing."""
        for node in nodes or self.nodes:
            pid = procs.recorded_pid(self._agent_record(node))
            seen: set[int] = set()
            while pid is not None:
                threads: list[int] = []
                with contextlib.suppress(FileNotFoundError):  # the agent exited meanwhile
                    threads = sorted({int(tid) for tid in os.listdir(f"/proc/{pid}/task")} - seen,
                                     key=lambda tid: tid != pid)
                if not threads:
                    break
                for tid in threads:
                    with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                        self._node_masks.setdefault(tid, (os.sched_getaffinity(tid),
                                                          os.getpriority(os.PRIO_PROCESS, tid)))
                        os.sched_setaffinity(tid, cpus)
                        os.setpriority(os.PRIO_PROCESS, tid, niceness)
                seen.update(threads)

    def release_nodes(self) -> None:
        """Undo `confine_nodes` for the agents' threads (pods started meanwhile keep their mask)."""
        masks, self._node_masks = self._node_masks, {}
        for tid, (mask, niceness) in masks.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, mask)
                os.setpriority(os.PRIO_PROCESS, tid, niceness)

    def _kill_node_processes(self, node: str) -> bool:
        # The agent first, so it does not observe (and report) its pods dying.
        found = procs.stop(self._agent_record(node), sig=signal.SIGKILL)
        for record in self.node_dir(node).glob("pods/*/*.pid"):
            found |= procs.stop(record, sig=signal.SIGKILL)
        return found

    # ----- nemeses -----------------------------------------------------------------------------

    def kill_node(self, node: str) -> None:
        """Node loss: SIGKILL the node's agent and every process of every pod it ran."""
        if node not in self.nodes:
            raise RigError(f"unknown node {node!r}; nodes are {self.nodes}")
        self._kill_node_processes(node)
        say(f"killed node {node} (agent and pods)")

    def restart_node(self, node: str, wait: bool = True) -> None:
        """Start a fresh agent for `node` (after kill_node: the node comes back, empty)."""
        self._kill_node_processes(node)
        self.start_node(node)
        if wait:
            self.wait_nodes_ready([node])

    def _pod_records(self, namespace: str, name: str) -> list[Path]:
        from kubernetes import client

        with self.api_client() as api:
            pod = client.CoreV1Api(api).read_namespaced_pod(name, namespace)
        pod_dir = self.node_dir(pod.spec.node_name) / "pods" / f"{namespace}_{name}_{pod.metadata.uid}"
        records = sorted(pod_dir.glob("*.pid"))
        if not records:
            raise RigError(f"pod {namespace}/{name} has no running process on {pod.spec.node_name}")
        return records

    def _signal_pod(self, namespace: str, name: str, sig: int) -> None:
        for record in self._pod_records(namespace, name):
            pid = procs.recorded_pid(record)
            if pid is not None:
                procs.signal_group(pid, sig)

    def kill_pod(self, namespace: str, name: str) -> None:
        """SIGKILL every process group of the pod (its containers die; the pod object stays)."""
        self._signal_pod(namespace, name, signal.SIGKILL)

    def pause_pod(self, namespace: str, name: str) -> None:
        """SIGSTOP every process group of the pod (a hung process: alive, but doing nothing)."""
        self._signal_pod(namespace, name, signal.SIGSTOP)

    def resume_pod(self, namespace: str, name: str) -> None:
        self._signal_pod(namespace, name, signal.SIGCONT)

    def restart_apiserver(self, hard: bool = False) -> None:
        """Stop kube-apiserver (SIGTERM, or SIGKILL if `hard`) and start it again; wait ready."""
        say("restarting kube-apiserver")
        procs.stop(self._record("kube-apiserver"), sig=signal.SIGKILL if hard else signal.SIGTERM)
        self._start_apiserver(binaries())
        self._wait_apiserver()

    def restart_etcd(self, hard: bool = False) -> None:
        """Stop etcd (SIGTERM, or SIGKILL if `hard`) and start it on the same data; wait healthy."""
        say("restarting etcd")
        procs.stop(self._record("etcd"), sig=signal.SIGKILL if hard else signal.SIGTERM)
        self._start_etcd(binaries())
        self._wait_etcd()
        self._wait_apiserver()

    def restart_controller_manager(self) -> None:
        say("restarting kube-controller-manager")
        self.stop_controller_manager()
        self.start_controller_manager()

    def stop_controller_manager(self) -> None:
        """No controller runs until `start_controller_manager` (Jobs get no pods, a deleted
        namespace stays Terminating with its contents)."""
        procs.stop(self._record("kube-controller-manager"))

    def start_controller_manager(self) -> None:
        self._start_controller_manager(binaries())
        self._wait_component("kube-controller-manager", self.ports["controller-manager"])

    # ----- clients -----------------------------------------------------------------------------

    def api_client(self):
        """A kubernetes.client.ApiClient for the admin user (close it, or use it as a context)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return run_kubectl(self.kubeconfig, *args, input=input, check=check, timeout=timeout)

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        """The output of a pod's container (the rig has no `kubectl logs`: no kubelet API)."""
        from kubernetes import client

        with self.api_client() as api:
            pod = client.CoreV1Api(api).read_namespaced_pod(name, namespace)
        container = container or pod.spec.containers[0].name
        pod_dir = self.node_dir(pod.spec.node_name) / "pods" / f"{namespace}_{name}_{pod.metadata.uid}"
        return (pod_dir / f"{container}.log").read_text(errors="replace")

    # ----- status ------------------------------------------------------------------------------

    def status(self) -> list[tuple[str, int | None, str]]:
        """(component, pid or None, health) for every control-plane component and agent."""
        checks = {
            "etcd": lambda: self._etcd_healthy()[0],
            "kube-apiserver": lambda: self._apiserver_ready()[0],
            "kube-controller-manager": lambda: self._https(
                f"https://127.0.0.1:{self.ports['controller-manager']}/healthz",
                client_cert=False)[0] == 200,
            "kube-scheduler": lambda: self._https(
                f"https://127.0.0.1:{self.ports['scheduler']}/healthz", client_cert=False)[0] == 200,
        }
        rows = []
        for component, check in checks.items():
            pid = procs.recorded_pid(self._record(component))
            try:
                health = "healthy" if pid and check() else ("unhealthy" if pid else "stopped")
            except (OSError, ssl.SSLError):
                health = "unhealthy" if pid else "stopped"
            rows.append((component, pid, health))
        for node in self.nodes:
            pid = procs.recorded_pid(self._agent_record(node))
            rows.append((f"agent {node}", pid, "running" if pid else "stopped"))
        return rows

    def running(self) -> bool:
        return all(pid for _, pid, _ in self.status())


def run_kubectl(kubeconfig: Path, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
    """kubectl with the given kubeconfig, text mode, output captured. A `--timeout=` of kubectl's
    own (`wait`) outlasts `timeout`: kubectl then answers by its own deadline."""
    cmd = ["kubectl", f"--kubeconfig={kubeconfig}", *args]
    result = subprocess.run(cmd, input=input, text=True, capture_output=True,
                            timeout=max(timeout, kubectl_timeout_seconds(args) + 10))
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, cmd, result.stdout, result.stderr)
    return result


def kubectl_timeout_seconds(args: tuple[str, ...]) -> float:
    """The seconds of a `--timeout=90s` (or `2m`, `1m30s`) among kubectl's arguments; 0 without one."""
    for arg in args:
        if arg.startswith("--timeout="):
            parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", arg.removeprefix("--timeout="))
            if parts is not None:
                return 60 * int(parts[1] or 0) + int(parts[2] or 0)
    return 0


def sweep_orphans(parent: Path | None = None) -> None:
    """Stop and delete rigs left by test sessions that died without teardown (their owner.pid
    is dead). Only state directories named retex-rig-* directly under the temp dir that have an
    owner record are considered (the CLI's rig has none), and only the processes they recorded
    are signalled.
    """
    parent = parent or Path(tempfile.gettempdir())
    for state_dir in parent.glob("retex-rig-*"):
        owner = state_dir / "owner.pid"
        if not owner.exists() or procs.recorded_pid(owner) is not None:
            continue
        if (state_dir / "rig.json").exists():
            say(f"stopping orphaned rig in {state_dir} (its owner process is gone)")
            Rig.load(state_dir).kill_recorded_processes()
        shutil.rmtree(state_dir, ignore_errors=True)
