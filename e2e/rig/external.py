"""An existing cluster behind the `rig` interface (RETEX_KUBECONFIG): how the same scenarios run
on kind. Clients yes; the rig's process-level nemeses as far as kind's node containers allow
them (a node's loss and return through `docker kill` / `docker start`, its partition by DROP
rules on its link set from inside its container, a pod frozen and resumed by signals sent from its
node's container, the API server and controller manager stopped through the control-plane node's
container runtime; not etcd).

Its pods are containers: they reach the host's services (the operator a test runs, the stubs)
at RETEX_POD_HOST, the host's address on the cluster's network, run RETEX_WORKER_IMAGE, and their
ends are recorded by a pod watch, since the reaper deletes a replaced attempt's Job with its pods.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from e2e.rig.controlplane import PodEnd, RigError, create_namespace, run_kubectl, say, wait_for


class RigUnavailable(RigError):
    """A nemesis was asked of an external cluster that only the rig has."""


def from_environment() -> ExternalCluster | None:
    """The cluster RETEX_KUBECONFIG names (a KindCluster when RETEX_KIND_CLUSTER is set too), or
    None: the local rig. How the tests' `rig` fixture and `make bench` choose."""
    kubeconfig = os.environ.get("RETEX_KUBECONFIG")
    if not kubeconfig:
        return None
    return (KindCluster if os.environ.get("RETEX_KIND_CLUSTER") else ExternalCluster)(Path(kubeconfig))


# A kind node's cpuset cgroups: its own subtree, where kind mounts it (cgroup v1); the unified
# hierarchy on a cgroup v2 host (not tried: these hosts are v1).
_CPUSET_ROOT = "$(test -d /sys/fs/cgroup/cpuset && echo /sys/fs/cgroup/cpuset || echo /sys/fs/cgroup)"

# A kind node's partition: iptables rules set from inside its container (`docker exec` needs no
# network), tagged so that healing deletes exactly them and nothing kube-proxy or Docker set. A
# DROP in any table netfilter runs drops, so the node's iptables backend (legacy or nft) does not
# matter. IPv6 is cut too where the node has it; `-w` waits for the lock kube-proxy may hold.
PARTITION_TAG = "retex-partition"
_EACH_FAMILY = "for ipt in iptables $(test -e /proc/net/if_inet6 && echo ip6tables); do"
# Deletes every rule tagged PARTITION_TAG; none left is no error (heal is idempotent).
HEAL_SCRIPT = (f"{_EACH_FAMILY} for chain in INPUT OUTPUT FORWARD; do "
               "rules=$($ipt -w 10 -S $chain) || exit 1; "
               f"echo \"$rules\" | grep -e '-m comment --comment {PARTITION_TAG} -j DROP$' | sed 's/^-A /-D /' | "
               "while read -r rule; do $ipt -w 10 $rule || exit 1; done || exit 1; done; done")
# Drops every packet through the node's link (its default route's interface: the kind network),
# in and out, the node's own and its pods' (forwarded), ahead of every other rule; traffic inside
# the node (loopback, pod to pod there) goes on, as when a node's link fails. Starts by healing, so
# a retried partition does not set its rules twice. Prints the link.
PARTITION_SCRIPT = (f"{HEAL_SCRIPT}; "
                    "link=$(ip route show default | sed -n '1s/.* dev \\([^ ]*\\).*/\\1/p'); "
                    "test -n \"$link\" || { echo 'no default route' >&2; exit 1; }; "
                    f"{_EACH_FAMILY} for spec in 'INPUT -i' 'OUTPUT -o' 'FORWARD -i' 'FORWARD -o'; do "
                    f"$ipt -w 10 -I $spec \"$link\" -m comment --comment {PARTITION_TAG} -j DROP || exit 1; "
                    "done; done; echo \"$link\"")
API_SERVER_PORT = 6443  # kubeadm's, which kind's nodes dial


class _PodEnds:
    """Every pod's end as it happens (exit code and output), from a watch of all pods: kept after
    the pod is deleted."""

    def __init__(self, api_client):
        self._api_client = api_client
        self._ends: dict[tuple[str, str], PodEnd] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="pod-ends", daemon=True).start()

    def of_job(self, namespace: str, job: str) -> list[PodEnd]:
        from kubernetes import client

        with self._api_client() as api:
            pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"job-name={job}").items
            live = {pod.metadata.name: self._read_end(client.CoreV1Api(api), pod)[0] for pod in pods}
        with self._lock:
            ended = {pod: end for (ns, pod), end in self._ends.items()
                     if ns == namespace and pod.startswith(f"{job}-")}
        return [ended.get(name) or live[name] for name in sorted(set(live) | set(ended))]

    def _watch(self) -> None:
        from kubernetes import client, watch

        delay = 0.5
        while True:
            try:
                with self._api_client() as api:
                    core = client.CoreV1Api(api)
                    for change in watch.Watch().stream(core.list_pod_for_all_namespaces, timeout_seconds=300):
                        delay = 0.5
                        pod = change["object"]
                        key = (pod.metadata.namespace, pod.metadata.name)
                        if key in self._ends or _exit_code(pod) is None:
                            continue
                        end, complete = self._read_end(core, pod)
                        if complete or change["type"] == "DELETED":  # else the pod's next event reads it again
                            with self._lock:
                                self._ends[key] = end
            except Exception as exc:  # noqa: BLE001 - a dropped watch is watched again
                say(f"pod watch restarts in {delay:.1f}s after {type(exc).__name__}: {str(exc)[:200]}")
                time.sleep(delay)  # an API server restarting refuses for seconds: not a busy loop
                delay = min(delay * 2, 8.0)

    @staticmethod
    def _read_end(core, pod) -> tuple[PodEnd, bool]:
        """The pod's end, and whether its log could be read."""
        try:
            log, complete = core.read_namespaced_pod_log(pod.metadata.name, pod.metadata.namespace), True
        except Exception:  # noqa: BLE001 - not started yet, or already gone
            log, complete = "", False
        return PodEnd(pod.metadata.name, _exit_code(pod), log), complete


def pod_cgroup_patterns(pod, containers_only: bool = False) -> list[str]:
    """What names a pod's processes in their /proc/<pid>/cgroup: the pod's cgroup names its uid
    (with underscores under the systemd cgroup driver); or, `containers_only`, the id of each
    container the kubelet has started (the sandbox's own process left out)."""
    if containers_only:
        statuses = (pod.status.container_statuses if pod.status else None) or []
        return [s.container_id.split("://", 1)[-1] for s in statuses if s.container_id]
    uid = pod.metadata.uid
    return [f"pod{uid}", f"pod{uid.replace('-', '_')}"]


def _exit_code(pod) -> int | None:
    for status in (pod.status.container_statuses or []) if pod.status else []:
        if status.state and status.state.terminated:
            return status.state.terminated.exit_code
    return None


class ExternalCluster:
    """The `rig` interface over an existing cluster."""

    state_dir = None
    cluster_type = "external"  # what ran a benchmark (e2e/bench.py): rig, kind or external

    def __init__(self, kubeconfig: Path):
        from kubernetes import client

        self.kubeconfig = kubeconfig
        self.pod_host = os.environ.get("RETEX_POD_HOST", "127.0.0.1")
        self.worker_image = os.environ.get("RETEX_WORKER_IMAGE", "retex-worker:dev")
        with self.api_client() as api:
            self.nodes = [n.metadata.name for n in client.CoreV1Api(api).list_node().items
                          if not any(t.effect == "NoSchedule" for t in n.spec.taints or [])]
        self._pod_ends = _PodEnds(self.api_client)

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return run_kubectl(self.kubeconfig, *args, input=input, check=check, timeout=timeout)

    def create_namespace(self, name: str) -> None:
        with self.api_client() as api:
            create_namespace(api, name)

    def pod_ends(self, namespace: str, job: str) -> list[PodEnd]:
        return self._pod_ends.of_job(namespace, job)

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        args = ["logs", "-n", namespace, name] + (["-c", container] if container else [])
        return self.kubectl(*args).stdout

    def _unavailable(self, what: str):
        raise RigUnavailable(f"{what} needs the local rig; RETEX_KUBECONFIG={self.kubeconfig} "
                             "is an external cluster")

    def kill_node(self, node: str) -> None:
        self._unavailable("kill_node")

    def restart_node(self, node: str, wait: bool = True) -> None:
        self._unavailable("restart_node")

    def partition_node(self, node: str) -> None:
        self._unavailable("partition_node")

    def heal_node(self, node: str) -> None:
        self._unavailable("heal_node")

    def kill_pod(self, namespace: str, name: str) -> None:
        self._unavailable("kill_pod")

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

    def stop_controller_manager(self) -> None:
        self._unavailable("stop_controller_manager")

    def start_controller_manager(self) -> None:
        self._unavailable("start_controller_manager")

    def confine_nodes(self, cpus: set[int], nodes: list[str] | None = None, *, niceness: int = 0) -> None:
        self._unavailable("confine_nodes")

    def release_nodes(self) -> None:
        self._unavailable("release_nodes")


class KindCluster(ExternalCluster):
    """A kind cluster (RETEX_KIND_CLUSTER names it): each node is a Docker container, so a node
    is lost by killing its container and comes back when the container starts again, and a pod's
    processes can be signalled from there (an ancestor of the pod's PID namespace)."""

    cluster_type = "kind"

    def __init__(self, kubeconfig: Path):
        from kubernetes import client

        super().__init__(kubeconfig)
        self._node_cpusets: dict[str, str] = {}
        with self.api_client() as api:
            control_plane = client.CoreV1Api(api).list_node(label_selector="node-role.kubernetes.io/control-plane").items[0]
        self._control_plane = control_plane.metadata.name
        self._api_server_address = next(a.address for a in control_plane.status.addresses if a.type == "InternalIP")

    def kill_node(self, node: str) -> None:
        subprocess.run(["docker", "kill", node], check=True, capture_output=True, timeout=60)
        say(f"killed node {node} (docker kill of its container)")

    def restart_node(self, node: str, wait: bool = True) -> None:
        subprocess.run(["docker", "start", node], check=True, capture_output=True, timeout=60)
        if wait:
            wait_for(f"node {node} Ready", lambda: self._ready(node), 180)

    def partition_node(self, node: str) -> None:
        """Cut the node off the network while everything on it keeps running (kubelet, runtime,
        pods): its kubelet cannot reach the API server, its pods neither it nor anything off the
        node (PARTITION_SCRIPT), until `heal_node`. `reaches_api_server` shows the cut."""
        link = self._on_node(node, PARTITION_SCRIPT, attempts=3)
        say(f"partitioned node {node} (every packet through its link {link} dropped: iptables rules {PARTITION_TAG})")

    def heal_node(self, node: str) -> None:
        """Delete the partition's rules; a node with none is healed already."""
        self._on_node(node, HEAL_SCRIPT, attempts=3)
        say(f"healed node {node} (iptables rules {PARTITION_TAG} deleted)")

    def reaches_api_server(self, node: str, seconds: float = 3) -> bool:
        """Whether a TCP connection from inside the node to the API server (the control-plane
        node's address, as the node's kubelet dials it) opens within `seconds`. False only when it
        times out, as packets dropped make it; anything else (refused, no bash) is an error, since
        it shows no partition."""
        probe = f"exec 3<>/dev/tcp/{self._api_server_address}/{API_SERVER_PORT}"
        done = subprocess.run(["docker", "exec", node, "timeout", str(seconds), "bash", "-c", probe],
                              capture_output=True, text=True, timeout=seconds + 60)
        if done.returncode not in (0, 124):  # 124: timeout's exit when it ended the probe
            raise RigError(f"on {node}: {probe!r} failed (exit {done.returncode}): {done.stderr.strip()}")
        return done.returncode == 0

    def _ready(self, node: str) -> bool:
        from kubernetes import client

        with self.api_client() as api:
            conditions = client.CoreV1Api(api).read_node(node).status.conditions or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    def kill_pod(self, namespace: str, name: str) -> None:
        """SIGKILL the processes of the pod's containers, as the rig's kill_pod: they die, the pod
        object and its sandbox stay, and the kubelet reports the containers' exit (137)."""
        self._signal_pod(namespace, name, "KILL", containers_only=True)

    def pause_pod(self, namespace: str, name: str) -> None:
        """SIGSTOP every process of the pod (a hung process: alive, but doing nothing). Sent from
        its node's container, so it reaches the container's PID 1 too, which could not stop itself."""
        self._signal_pod(namespace, name, "STOP")

    def resume_pod(self, namespace: str, name: str) -> None:
        self._signal_pod(namespace, name, "CONT")

    def confine_nodes(self, cpus: set[int], nodes: list[str] | None = None, *, niceness: int = 0) -> None:
        """Run the schedulable nodes' (`nodes`, or all) containers (kubelet, runtime and every
        pod) on `cpus` only (benchmarks, as the rig's confine_nodes) until `release_nodes`. Their
        CPU weight is the cgroup's, not a niceness: none is set here."""
        if niceness:
            raise RigUnavailable("a kind node's pods at a lower CPU priority (niceness)")
        wanted = ",".join(map(str, sorted(cpus)))
        for node in nodes or self.nodes:
            self._node_cpusets.setdefault(node, self._on_node(node, f"cat {_CPUSET_ROOT}/cpuset.cpus"))
            self._write_cpusets(node, wanted, deepest_first=True)
        say(f"nodes {', '.join(nodes or self.nodes)} confined to CPUs {wanted} (their cpuset cgroups)")

    def release_nodes(self) -> None:
        saved, self._node_cpusets = self._node_cpusets, {}
        for node, cpuset in saved.items():
            self._write_cpusets(node, cpuset, deepest_first=False)

    def _write_cpusets(self, node: str, cpus: str, *, deepest_first: bool) -> None:
        """Every cpuset cgroup of the node (kind mounts the node's own subtree), children before
        their parent when shrinking and after it when growing: a cgroup v1 cpuset must stay within
        its parent's, so `docker update --cpuset-cpus` of the node alone is refused ("device or
        resource busy") while its pods' cgroups use other CPUs. A pod's cgroup created meanwhile can
        refuse its parent's write, or copy its parent's old set: the pass is checked (every cgroup
        shows `cpus`) and tried again. Each cgroup gets `cpus`, not a value of its own from before
        (kind's nodes set none: every one of them shows the node's)."""
        order = "-rn" if deepest_first else "-n"
        every = f"find {_CPUSET_ROOT} -name cpuset.cpus"
        script = (f"for f in $({every} | awk -F/ '{{print NF, $0}}' | sort {order} | cut -d' ' -f2-); do "
                  f"echo '{cpus}' > $f 2>/dev/null || test ! -e $f || exit 1; done; "
                  f"test -z \"$({every} -exec cat {{}} + | grep -vx '{cpus}')\"")
        self._on_node(node, script, attempts=3)

    def _signal_pod(self, namespace: str, name: str, signal_name: str, containers_only: bool = False) -> None:
        from kubernetes import client

        with self.api_client() as api:
            pod = client.CoreV1Api(api).read_namespaced_pod(name, namespace)
        found = pod_cgroup_patterns(pod, containers_only)
        if not found:
            raise RigError(f"SIG{signal_name} to pod {namespace}/{name}: no running container")
        patterns = " ".join(f"-e '{p}'" for p in found)
        # A SIGKILL may take a process whose parent it killed first: one already gone is no failure.
        tolerate = " 2>/dev/null; true" if signal_name == "KILL" else ""
        script = (f"pids=$(grep -l {patterns} /proc/[0-9]*/cgroup 2>/dev/null | cut -d/ -f3); "
                  f"test -n \"$pids\" || {{ echo 'no process in its cgroup' >&2; exit 1; }}; "
                  f"kill -{signal_name} $pids{tolerate} && echo $pids")
        pids = self._on_node(pod.spec.node_name, script)
        say(f"SIG{signal_name} to pod {namespace}/{name}: processes {pids} on {pod.spec.node_name}")

    def restart_apiserver(self, hard: bool = False) -> None:
        """Stop kube-apiserver (SIGTERM, SIGKILL 5 s later; or SIGKILL at once if `hard`) and
        start it again; wait ready. The stop is the container runtime's, not kubelet's: kubelet's
        graceful pod deletion let kubeadm's API server drain for over 28 s here, longer than a
        lease's renew deadline, which is not the outage R16 is about."""
        say(f"restarting kube-apiserver on {self._control_plane}{' (SIGKILL)' if hard else ''}")
        self._stop_static_pod("kube-apiserver", grace_seconds=0 if hard else 5)
        self._start_static_pod("kube-apiserver")
        wait_for("kube-apiserver ready",
                 lambda: self.kubectl("get", "--raw", "/readyz", "--request-timeout=5s", check=False).returncode == 0, 180)

    def stop_controller_manager(self) -> None:
        """No controller runs until `start_controller_manager` (Jobs get no pods, a deleted
        namespace stays Terminating with its contents)."""
        say(f"stopping kube-controller-manager on {self._control_plane}")
        self._stop_static_pod("kube-controller-manager", grace_seconds=5)

    def start_controller_manager(self) -> None:
        self._start_static_pod("kube-controller-manager")
        wait_for("kube-controller-manager running",
                 lambda: self._on_control_plane("crictl ps -q --state running --name kube-controller-manager"), 120)

    def restart_controller_manager(self) -> None:
        self.stop_controller_manager()
        self.start_controller_manager()

    # A static pod's manifest moved out of kubelet's directory stops the pod, and moved back starts
    # a new one at once (not a container restart behind CrashLoopBackOff).
    def _stop_static_pod(self, name: str, grace_seconds: int) -> None:
        self._on_control_plane(f"mv /etc/kubernetes/manifests/{name}.yaml /etc/kubernetes/{name}.yaml")
        self._on_control_plane(f"crictl ps -q --name {name} | xargs -r crictl stop --timeout {grace_seconds} >/dev/null")
        wait_for(f"{name}'s container to stop", lambda: not self._on_control_plane(f"crictl ps -q --name {name}"), 120)

    def _start_static_pod(self, name: str) -> None:
        self._on_control_plane(f"mv /etc/kubernetes/{name}.yaml /etc/kubernetes/manifests/{name}.yaml")

    def _on_control_plane(self, script: str) -> str:
        return self._on_node(self._control_plane, script)

    @staticmethod
    def _on_node(node: str, script: str, attempts: int = 1) -> str:
        """The script's output; a script that may fail for a moment (a race, a busy Docker) and is
        safe to run again gets `attempts` tries, a second apart."""
        for attempt in range(1, attempts + 1):
            done = subprocess.run(["docker", "exec", node, "sh", "-c", script], capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                return done.stdout.strip()
            failure = f"on {node}: {script!r} failed (exit {done.returncode}): {done.stderr.strip()}"
            if attempt < attempts:
                say(f"{failure}; trying again")
                time.sleep(1)
        raise RigError(failure)
