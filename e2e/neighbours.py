"""A hostile tenant and its victim, for the noisy-neighbour test and benchmark.

The hostile tenant makes every attack a tenant can make on what it shares with the others, from
its own namespace and with its own pods' tokens (step code can read them): connections trickling
headers without a token (slowloris), a flood of authenticated calls, the largest replies asked for
and read slowly, a `start_run` loop, a create/delete loop of Tasks; and, set up before, Pending
pods labelled as workers with large annotations and many top-priority tasks. The continuous
attacks run in a process of their own (`python -m e2e.neighbours`). In a cluster each tenant's pods
get the CPU they request, on nodes apart from the control plane and the operator; the test
machine has 2 cores, so the hostile tenant's pods run on a node of their own confined to the
last core at the lowest CPU priority (`confine_nodes`, niceness 19), its attacking process with
them, and the victim's pods on another node, for both of the victim's runs: the hostile tenant
takes what CPU the rest leaves, as if it had machines of its own. What it costs the shared
operator, API server and ledger is what the victim's latency shows.

The victim runs ordinary one-step tasks, one every half second; what is measured is each one's
seconds from its creation to its step's start in the ledger.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config

from e2e.attempt_identity import pod_token
from e2e.system import ANY_TASK_POLICY, prepare_namespace, wait_for
from retex.kube.objects import LABEL_TASK_UID
from retex.ledger import Ledger

GROUP, VERSION = "retex.dev", "v1alpha1"
BIG_STEPS = 60  # each printing 32 KiB: a `get` of the task is about 2 MiB


def sh(name: str, script: str) -> dict[str, Any]:
    return {"name": name, "exec": {"command": ["sh", "-c", script]}}


def create_task(api: client.ApiClient, namespace: str, name: str, steps: list[dict[str, Any]], **spec: Any) -> str:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Task", "metadata": {"name": name},
            "spec": {"steps": steps, **spec}}
    created = client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, namespace, "tasks", body)
    return str(created["metadata"]["uid"])


def on_node(node: str) -> dict[str, Any]:
    return {"nodeSelector": {"kubernetes.io/hostname": node}}


def tenant_client(kubeconfig: str, user: str) -> client.ApiClient:
    """An API client acting as `user` (impersonated by the cluster's admin): what the API
    server's admission sees of a tenant."""
    configuration = client.Configuration()
    config.load_kube_config(kubeconfig, client_configuration=configuration)
    api = client.ApiClient(configuration)
    api.set_default_header("Impersonate-User", user)
    return api


TENANT_RIGHTS = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list"]},
                 {"apiGroups": [GROUP], "resources": ["tasks"], "verbs": ["create", "delete", "get", "list"]}]


# -- the victim --------------------------------------------------------------------------------


@dataclass(frozen=True)
class VictimRun:
    first_step: list[float]  # each task's seconds from its creation to its step's start
    # The same, by stage (p95 of each, seconds): created → admitted to the ledger → given a run
    # slot (its attempt started) → its step started (the Job, the pod, the worker).
    stages: dict[str, float]


def victim_run(ledger: Ledger, api: client.ApiClient, namespace: str, label: str, count: int, node: str) -> VictimRun:
    """`count` one-step tasks on `node`, one every 0.5 s, once all have succeeded with nothing
    lost to a disruption or a failure."""
    submitted: dict[str, float] = {}
    for n in range(count):
        create_task(api, namespace, f"{label}-{n}", [sh("work", "true")], worker=on_node(node))
        submitted[f"{label}-{n}"] = time.time()
        time.sleep(0.5)

    def all_succeeded() -> dict[str, Any] | None:
        got = {name: ledger.find(namespace, name) for name in submitted}
        return got if all(r is not None and r.phase == "Succeeded" for r in got.values()) else None

    done = wait_for(all_succeeded, timeout=300, what=f"the victim's {label} tasks Succeeded")
    for record in done.values():
        assert (record.disruptions, record.failures, record.dead_lettered) == (0, 0, False), record
    marks = {name: (at, done[name].created_at.timestamp(), ledger.attempts(done[name].uid)[0].started_at.timestamp(),
                    done[name].steps[0].started_at.timestamp()) for name, at in submitted.items()}
    return VictimRun(first_step=[step - at for at, _, _, step in marks.values()],
                     stages={"admitted": round(p95([admitted - at for at, admitted, _, _ in marks.values()]), 2),
                             "slot": round(p95([placed - admitted for _, admitted, placed, _ in marks.values()]), 2),
                             "pod and worker": round(p95([step - placed for _, _, placed, step in marks.values()]), 2)})


# -- the hostile tenant's set-up ---------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    """A hostile task's running worker, as its step code holds it."""

    uid: str
    epoch: int
    token: str


def running_worker(ledger: Ledger, api: client.ApiClient, namespace: str, uid: str, token_file: Path) -> Worker:
    core = client.CoreV1Api(api)

    def running_pod() -> client.V1Pod | None:
        pods = core.list_namespaced_pod(namespace, label_selector=f"{LABEL_TASK_UID}={uid}").items
        return next((p for p in pods if p.status.phase == "Running"), None)

    pod = wait_for(running_pod, timeout=120, what=f"a running worker pod of task {uid}")
    return Worker(uid=uid, epoch=ledger.get(uid).epoch, token=pod_token(api, pod, token_file).read_text())


def decoy_pods(api: client.ApiClient, namespace: str, count: int) -> dict[str, int]:
    """Pending pods carrying the workers' label, each with 200 KiB of annotations: how many the
    API server took, refused by the label's policy, and refused for another reason."""
    core, outcome = client.CoreV1Api(api), {"created": 0, "refused": 0, "refused otherwise": 0}
    for n in range(count):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"decoy-{n}", "labels": {LABEL_TASK_UID: str(uuid.uuid4())},
                            "annotations": {f"pad-{k}": "x" * 50_000 for k in range(4)}},
               "spec": {"nodeSelector": {"retex.dev/test-node": "nowhere"},
                        "containers": [{"name": "c", "image": "retex-worker:local"}]}}
        try:
            core.create_namespaced_pod(namespace, pod)
            outcome["created"] += 1
        except client.ApiException as exc:
            outcome["refused" if "only the Job controller creates one" in (exc.body or "") else "refused otherwise"] += 1
    return outcome


# -- the continuous attacks, in a process of their own ------------------------------------------


@dataclass(frozen=True)
class Attacks:
    kubeconfig: str
    user: str  # the tenant the API server takes the attacker for (impersonated)
    namespace: str
    node: str  # where the tenant's pods run
    endpoint_port: int
    ca_file: str
    sleeper: Worker  # a task holding its step: its token floods and loops start_run
    big: Worker  # a task of BIG_STEPS large results: its `get` is the largest reply
    slowloris: int = 100
    flood_threads: int = 2
    slow_readers: int = 60
    churn_threads: int = 4


class HostileProcess:
    """The attacks running in a niced child process until `stop`, which returns what each achieved."""

    def __init__(self, attacks: Attacks, workdir: Path, cpus: set[int]):
        self._counts = workdir / "hostile-counts.json"
        spec = workdir / "hostile-attacks.json"
        spec.write_text(json.dumps(asdict(attacks)))
        self._proc = subprocess.Popen(["taskset", "-c", ",".join(map(str, sorted(cpus))), "nice", "-n", "19",
                                       sys.executable, "-m", "e2e.neighbours", str(spec), str(self._counts)])

    def stop(self) -> dict[str, int]:
        self._proc.send_signal(signal.SIGTERM)
        self._proc.wait(60)
        counts: dict[str, int] = json.loads(self._counts.read_text())
        return counts


class _Attacker:
    def __init__(self, attacks: Attacks):
        self.attacks = attacks
        self.stopped = threading.Event()
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._tls = ssl.create_default_context(cafile=attacks.ca_file)
        self.api = tenant_client(attacks.kubeconfig, attacks.user)

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def spawn(self, name: str, loop: Callable[[], None], copies: int = 1) -> None:
        def forever() -> None:
            while not self.stopped.is_set():
                try:
                    loop()
                except (OSError, urllib3.exceptions.HTTPError):
                    self.count(f"{name}: connection error")
                    self.stopped.wait(0.05)

        for n in range(copies):
            thread = threading.Thread(target=forever, name=f"{name}-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def call(self, http: urllib3.PoolManager, worker: Worker, operation: str, **body: Any) -> None:
        reply = http.request("POST", f"https://127.0.0.1:{self.attacks.endpoint_port}/v1/attempt/{operation}",
                             body=json.dumps({"uid": worker.uid, **body}).encode(), retries=False, timeout=35,
                             headers={"Authorization": f"Bearer {worker.token}", "Content-Type": "application/json"})
        self.count(f"{operation} {reply.status}")

    def run(self) -> None:
        a = self.attacks
        self.spawn("slowloris", self.slowloris, a.slowloris)
        flood = urllib3.PoolManager(ca_certs=a.ca_file, cert_reqs="CERT_REQUIRED", maxsize=a.flood_threads)
        self.spawn("flood", lambda: self.call(flood, a.sleeper, "seconds_until_step_deadline", idx=0,
                                              begun_at=None, after_seconds=0), a.flood_threads)
        self.spawn("slow-get", self.slow_get, a.slow_readers)
        loop = urllib3.PoolManager(ca_certs=a.ca_file, cert_reqs="CERT_REQUIRED")
        self.spawn("start_run", lambda: self.call(loop, a.sleeper, "start_run", epoch=a.sleeper.epoch, idx=0))
        serial = iter(range(10**9))
        self.spawn("churn", lambda: self.churn(next(serial)), a.churn_threads)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self._threads:
            thread.join(40)

    def slowloris(self) -> None:
        """Headers trickled a byte a second, no token."""
        with socket.create_connection(("127.0.0.1", self.attacks.endpoint_port), timeout=15) as raw, \
                self._tls.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            self.count("slowloris connection")
            for byte in b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"x" * 10_000:
                if self.stopped.is_set():
                    return
                sock.sendall(bytes([byte]))
                self.stopped.wait(1.0)

    def slow_get(self) -> None:
        """The largest reply the tenant can make, read through a window of a few KiB, a little at a
        time, never to the end."""
        body = json.dumps({"uid": self.attacks.big.uid}).encode()
        request = (b"POST /v1/attempt/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                   + self.attacks.big.token.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                   + b"\r\n\r\n" + body)
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.settimeout(40)
        raw.connect(("127.0.0.1", self.attacks.endpoint_port))
        with self._tls.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(request)
            status = sock.recv(16)[9:12].decode(errors="replace")
            self.count(f"slow get {status}")
            if status != "200":
                self.stopped.wait(1.0)  # as told by Retry-After
                return
            while not self.stopped.is_set() and sock.recv(512):
                self.stopped.wait(0.5)

    def churn(self, serial: int) -> None:
        """A Task created, and deleted once the operator has judged it (admitted, or refused)."""
        name, custom = f"churn-{serial}", client.CustomObjectsApi(self.api)
        create_task(self.api, self.attacks.namespace, name, [sh("work", "true")], worker=on_node(self.attacks.node))
        self.count("churn created")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not self.stopped.is_set():
            status = custom.get_namespaced_custom_object(GROUP, VERSION, self.attacks.namespace, "tasks",
                                                         name).get("status") or {}
            if status.get("phase"):
                accepted = next((c for c in status.get("conditions") or [] if c.get("type") == "Accepted"), {})
                refused = f" {accepted.get('reason')}" if accepted.get("status") == "False" else ""
                self.count(f"churn {status['phase']}{refused}")
                break
            self.stopped.wait(0.2)
        with contextlib.suppress(client.ApiException):
            custom.delete_namespaced_custom_object(GROUP, VERSION, self.attacks.namespace, "tasks", name)


# -- the scenario: the victim's run, calm, then under every attack -----------------------------


def prepare_hostile_namespace(kubectl: Callable[..., Any], namespace: str, user: str, *, max_running: int) -> None:
    """A namespace onboarded as any tenant's, its TaskPolicy capping its running tasks at
    `max_running` (with a global run limit, the cap is what keeps slots for the others: a slot a
    tenant took while alone stays its own until its task ends), where `user` may create pods and
    Tasks."""
    prepare_namespace(kubectl, namespace, {**ANY_TASK_POLICY, "spec": {**ANY_TASK_POLICY["spec"],
                                                                      "maxRunning": max_running}})
    for obj in ({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "hostile"},
                 "rules": TENANT_RIGHTS},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "hostile"},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "hostile"},
                 "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}):
        kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj))


@dataclass(frozen=True)
class Neighbours:
    """Who is who, and how big each side's part is."""

    victim: str
    hostile: str
    user: str  # the hostile tenant's user (prepare_hostile_namespace)
    victim_tasks: int = 20
    greedy_tasks: int = 200  # priority 1000, a few seconds each
    decoy_pods: int = 50


@dataclass
class Outcome:
    calm: VictimRun  # the victim's run without the attack
    attacked: VictimRun  # and during it
    attacks: dict[str, int]  # what each continuous attack achieved (HostileProcess.stop)
    decoys: dict[str, int]
    start_run_history: int  # history rows the start_run loop added
    memory: dict[str, int]  # the operator's: calm peak, RSS after its restart, peak under attack (bytes)

    @property
    def ratio(self) -> float:
        return p95(self.attacked.first_step) / p95(self.calm.first_step)


def p95(samples: list[float]) -> float:
    """As e2e.bench's percentiles and charts read it (inclusive)."""
    return statistics.quantiles(samples, n=100, method="inclusive")[94]


def process_memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (its peak) of a process, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def run_scenario(who: Neighbours, *, rig: Any, ledger: Ledger, operator_pid: Callable[[], int],
                 restart_operator: Callable[[], None], endpoint_port: int, ca_file: str, workdir: Path) -> Outcome:
    """The victim's run alone; the hostile set-up (a task holding its step, one of large results,
    `greedy_tasks` top-priority tasks, labelled decoy pods, then an operator restart so its
    watches list them); the victim's run again under the continuous attacks. `rig` is the
    cluster (e2e.rig: the local rig or kind): the victim's pods run on its first node, the hostile
    tenant's on its last, confined to the last core meanwhile."""
    cpus = os.sched_getaffinity(0)
    pods_cpus = {max(cpus)} if len(cpus) > 1 else cpus
    rig.confine_nodes(pods_cpus, [rig.nodes[-1]], niceness=19)
    try:
        with rig.api_client() as api:
            return _scenario(who, rig=rig, api=api, ledger=ledger, operator_pid=operator_pid,
                             restart_operator=restart_operator, endpoint_port=endpoint_port, ca_file=ca_file,
                             workdir=workdir, pods_cpus=pods_cpus)
    finally:
        rig.release_nodes()


def _scenario(who: Neighbours, *, rig: Any, api: client.ApiClient, ledger: Ledger, operator_pid: Callable[[], int],
              restart_operator: Callable[[], None], endpoint_port: int, ca_file: str, workdir: Path,
              pods_cpus: set[int]) -> Outcome:
    kubeconfig, hostile_node = str(rig.kubeconfig), on_node(rig.nodes[-1])
    calm = victim_run(ledger, api, who.victim, "calm", who.victim_tasks, rig.nodes[0])
    calm_peak = process_memory(operator_pid())["VmHWM"]
    sleeper = create_task(api, who.hostile, "sleeper", [sh("hold", "sleep 600")], priority=1000, worker=hostile_node)
    big = create_task(api, who.hostile, "big", [sh(f"s{n}", "head -c 40000 /dev/zero | tr '\\0' x")
                                                for n in range(BIG_STEPS)] + [sh("hold", "sleep 600")],
                      priority=1000, worker=hostile_node)
    sleeper_worker = running_worker(ledger, api, who.hostile, sleeper, workdir / "sleeper-token")
    big_worker = running_worker(ledger, api, who.hostile, big, workdir / "big-token")
    wait_for(lambda: sum(s.state == "done" for s in ledger.get(big).steps) == BIG_STEPS, timeout=180,
             what="the big task's results committed")
    for n in range(who.greedy_tasks):
        create_task(api, who.hostile, f"greedy-{n}", [sh("hold", "sleep 3")], priority=1000, worker=hostile_node)
    history_before = len(ledger.history(sleeper))
    decoys = decoy_pods(tenant_client(kubeconfig, who.user), who.hostile, who.decoy_pods)
    restart_operator()
    restarted = process_memory(operator_pid())["VmRSS"]
    hostile = HostileProcess(Attacks(kubeconfig=kubeconfig, user=who.user, namespace=who.hostile, node=rig.nodes[-1],
                                     endpoint_port=endpoint_port, ca_file=ca_file,
                                     sleeper=sleeper_worker, big=big_worker), workdir, pods_cpus)
    try:
        time.sleep(5)  # every attack under way before the victim's run starts
        attacked = victim_run(ledger, api, who.victim, "attacked", who.victim_tasks, rig.nodes[0])
    finally:
        attacks = hostile.stop()
    return Outcome(calm=calm, attacked=attacked, attacks=attacks, decoys=decoys,
                   start_run_history=len(ledger.history(sleeper)) - history_before,
                   memory={"calm_peak": calm_peak, "restarted": restarted,
                           "attacked_peak": process_memory(operator_pid())["VmHWM"]})


def main() -> None:
    spec, out = Path(sys.argv[1]), Path(sys.argv[2])
    raw = json.loads(spec.read_text())
    attacker = _Attacker(Attacks(**{**raw, "sleeper": Worker(**raw["sleeper"]), "big": Worker(**raw["big"])}))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    attacker.run()
    stop.wait()
    attacker.stop()
    out.write_text(json.dumps(attacker.counts, sort_keys=True))
    os._exit(0)  # daemon threads blocked in a read need not be waited for


if __name__ == "__main__":
    main()
