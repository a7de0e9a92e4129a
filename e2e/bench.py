"""`make bench`: retex measured side by side with what users would run instead, on the local rig or kind.

    python -m e2e.bench [--quick] [--size NAME=N ...] [MEASURE ...]
        measures: writes checkpoint latency throughput recovery node-loss profile ledger scale (run in this order)

On the local rig it starts by default; with RETEX_KUBECONFIG (and RETEX_KIND_CLUSTER, RETEX_POD_HOST,
RETEX_WORKER_IMAGE), the variables the scenario tests run on kind with (e2e/kind/run.sh), it runs on
that cluster instead: the operator and Postgres stay processes of this host, as in those tests.

Every measure runs retex and its baseline in the same run, on the same machine, interleaved where
it can be, and reports both figures and their ratio (the machines are shared and noisy: only the
ratio means much). Results go to docs/benchmarks/results-rig.json, charts to docs/benchmarks/*.png
(on kind: docs/benchmarks/results-kind.json and docs/benchmarks/kind/); the results name the cluster
and the commit, and docs/benchmarks.md's table is checked against them (e2e.benchpage). A measure the
cluster cannot run (a nemesis only the rig has) is listed under `not_measured` with why. A target
missed prints FALL SHORT but never fails: targets are for people, not CI. docs/benchmarks.md
explains each figure. `--quick` runs tiny sizes (the smoke that `make test` runs so this does not rot).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
from kubernetes import client, watch

from e2e.cpu import CpuAccount
from e2e.neighbours import Neighbours, p95, prepare_hostile_namespace, run_scenario
from e2e.postgres import PostgresServer
from e2e.rig.controlplane import Rig, wait_for
from e2e.rig.external import ExternalCluster, RigUnavailable, from_environment
from e2e.system import (
    OperatorProcess,
    bind_finalizer_policy,
    discard_namespace,
    install_crd,
    prepare_namespace,
    serves_mutating_policies,
    unbind_finalizer_policy,
)
from retex.api import GROUP, PLURAL, VERSION
from retex.kube.election import ElectionTiming
from retex.ledger import Ledger, TaskAdmission
from retex.machine import TaskEvent, TaskPhase
from retex.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parent.parent
CHARTS = REPO / "docs" / "benchmarks"
RESULTS = CHARTS / "results-rig.json"
LEASE_SECONDS = 10  # the recovery measure's lease duration
DEPLOYED_ELECTION = ElectionTiming()  # the operator's leader election, as the chart deploys it
# The status mirror's full resync as deployed (the tests' 5 s would LIST every Task every 5 s:
# at 5,000 Tasks, seconds of the mirror's thread that no user's operator spends).
DEPLOYED_RESYNC_SECONDS = OperatorSettings.resync_seconds
DEPLOYED_OPERATOR_ENV = {"RETEX_LEADER_LEASE_SECONDS": f"{DEPLOYED_ELECTION.lease_duration:g}",
                         "RETEX_LEADER_RENEW_DEADLINE_SECONDS": f"{DEPLOYED_ELECTION.renew_deadline:g}",
                         "RETEX_LEADER_RETRY_SECONDS": f"{DEPLOYED_ELECTION.retry_period:g}",
                         "RETEX_RESYNC_SECONDS": f"{DEPLOYED_RESYNC_SECONDS:g}"}
OBSERVED_DEATH_TARGET_SECONDS = 3.0
# Kubernetes' own defaults evict a lost node's pods after about 5 min (a 40–50 s grace, then 300 s
# of toleration); the rig shortens both (e2e.rig.controlplane.Timing).
NODE_LOSS_JOB_TIMEOUT = 600
DELETE_COLLECTION_TRIES = 10  # the scale measure's one deletecollection, asked again after a 5xx
WORKER_PROCESS_STARTED = "process started"  # a timeline's event: a worker line's time less its process_age_seconds


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Sizes:
    checkpoint_steps: int = 64  # a gate, then no-op steps: as many as a Task may hold (MAX_STEPS)
    checkpoint_parallel: int = 8
    latency_tasks: int = 50
    throughput_tasks: int = 300
    throughput_limit: int = 10
    recovery_runs: int = 10
    node_loss_runs: int = 3  # each kills a node: lease expiry on retex's side, eviction on the Job's
    # The bare Job's toleration of an unreachable node; 0 keeps the cluster's default (Kubernetes:
    # 300 s, so a sample takes 6 min on kind). The smoke shortens it: it checks the harness, not the Job.
    node_loss_job_toleration_seconds: int = 0
    profile_tasks: int = 3
    ledger_tasks: int = 1000
    writes_tasks: int = 10
    scale_tasks: int = 5000  # all of them, the runnable ones included
    scale_runnable: int = 50
    neighbour_victim_tasks: int = 20
    neighbour_greedy_tasks: int = 200
    # How long a window of `writes` or a round of `checkpoint` waits for the cluster to stop
    # writing; the smoke's is short (it shares its cluster with the other tests' leftovers).
    quiet_timeout_seconds: int = 120

    @classmethod
    def quick(cls) -> Sizes:
        return cls(checkpoint_steps=5, checkpoint_parallel=2, latency_tasks=2, throughput_tasks=4,
                   throughput_limit=2, recovery_runs=1, node_loss_runs=1,
                   node_loss_job_toleration_seconds=5, profile_tasks=1, ledger_tasks=10,
                   writes_tasks=2, scale_tasks=40, scale_runnable=4, neighbour_victim_tasks=4,
                   neighbour_greedy_tasks=4, quiet_timeout_seconds=10)

    def with_overrides(self, overrides: list[str]) -> Sizes:
        """These sizes with `NAME=N` overrides (e.g. `latency_tasks=10`): sizes between --quick and full."""
        names = {f.name for f in fields(self)}
        changed = {}
        for item in overrides:
            name, _, value = item.partition("=")
            if name not in names or not value.isdigit():
                raise ValueError(f"--size {item!r}: expected NAME=N with NAME one of {', '.join(sorted(names))}")
            changed[name] = int(value)
        return replace(self, **changed)


@dataclass
class Figure:
    """One measure: retex's figure, the baseline's from the same run, their ratio and the target."""
    measure: str
    unit: str
    retex: float
    baseline: float
    baseline_name: str
    ratio: float  # as the target reads it (see `target`)
    target: str
    met: bool | None  # None: not judged, the measure's conditions did not hold (its detail says which)
    detail: dict[str, Any] = field(default_factory=dict)
    # The samples behind the figure, each side's, in `samples_unit` (the figure's unit when empty):
    # the charts draw their distributions. Empty where the figure is one total (a rate, a size).
    retex_samples: list[float] = field(default_factory=list)
    baseline_samples: list[float] = field(default_factory=list)
    samples_unit: str = ""
    target_at: float | None = None  # where the target puts retex's samples, in their unit; None: no such line


def verdict(met: bool | None) -> str:
    return "NOT JUDGED" if met is None else "PASS" if met else "FALL SHORT"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


class Markers:
    """When each marker command started (its `date`, host clock: kind's nodes share this host's
    clock), sent over HTTP where the cluster's pods reach this host: on kind a pod sees no file of
    this host."""

    def __init__(self, host: str):
        self._starts: dict[str, list[float]] = {}
        self._waiting: set[str] = set()
        self._open: set[str] = set()
        self._lock = threading.Lock()
        starts, waiting, opened, lock = self._starts, self._waiting, self._open, self._lock

        class Record(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # /<name>/<seconds>, or /gate/<name>
                if self.path.startswith("/gate/"):
                    name = self.path.removeprefix("/gate/")
                    with lock:
                        waiting.add(name)
                        body = b"open" if name in opened else b"shut"
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                name, _, stamp = self.path.strip("/").rpartition("/")
                try:
                    at = float(stamp)
                except ValueError:
                    self.send_response(400)
                else:
                    with lock:
                        starts.setdefault(name, []).append(at)
                    self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Record)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def command(self, name: str, then: str = "") -> list[str]:
        """A command that records the moment it starts under `name`, then runs `then`."""
        send = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)"
        return ["sh", "-c", f"t=$(date +%s.%N); python3 -c '{send}' {self.url}/{name}/$t{'; ' + then if then else ''}"]

    def starts(self, name: str) -> list[float]:
        with self._lock:
            return sorted(self._starts.get(name, []))

    def gate_command(self, name: str) -> list[str]:
        """A command that waits until `open_gates` opens `name`'s gate (`waiting` shows it there)."""
        poll = (f"import time, urllib.request\n"
                f"while True:\n"
                f"    try:\n"
                f"        if urllib.request.urlopen('{self.url}/gate/{name}', timeout=10).read() == b'open':\n"
                f"            break\n"
                f"    except OSError:\n"
                f"        pass\n"
                f"    time.sleep(0.05)")
        return ["python3", "-c", poll]

    def waiting(self) -> set[str]:
        with self._lock:
            return set(self._waiting)

    def open_gates(self, names: set[str]) -> None:
        with self._lock:
            self._open.update(names)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class BenchSystem:
    """retex on a cluster for benchmarks: its own ledger database, namespace and operator. Uses a
    cluster (the local rig or kind) and Postgres it is given (the smoke test's session ones) or
    starts its own."""

    def __init__(self, rig: Rig | ExternalCluster, postgres: PostgresServer, *, workdir: Path):
        self.rig, self.postgres = rig, postgres
        self.markers = Markers(rig.pod_host)
        self.namespace = f"bench-{uuid.uuid4().hex[:6]}"
        database = self.namespace.replace("-", "_")
        with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {database}")
        self.dsn = postgres.dsn(dbname=database)
        install_crd(rig.kubectl)
        prepare_namespace(rig.kubectl, self.namespace)
        # As the chart installs retex where the API server serves it (Kubernetes 1.36 and later).
        self.finalizer_binding = (bind_finalizer_policy(rig.kubectl, self.namespace)
                                  if serves_mutating_policies(rig.kubectl) else None)
        self.workdir = workdir
        self.operator_log = workdir / "operator.log"
        self.operator = OperatorProcess.on(rig, self.dsn, self.operator_log, extra_env={"RETEX_NAMESPACES": self.namespace})
        # The leader election and the resync as deployed, not the tests' short ones (made for
        # restarting operators and quick convergence, which no measure needs): a loaded operator
        # renews its leadership and resyncs as a user's would.
        self.operator.start(**DEPLOYED_OPERATOR_ENV)
        self.ledger = Ledger(self.dsn).open()
        self._api = rig.api_client()
        self.custom, self.batch = client.CustomObjectsApi(self._api), client.BatchV1Api(self._api)
        self.core = client.CoreV1Api(self._api)

    @contextmanager
    def operator_with(self, **env: str) -> Iterator[None]:
        """The operator restarted with `env` on top of its deployed settings, and as before after:
        a restart with `env` alone falls back to the tests' election and resync, and a limit would
        stay, for every later measure. Graceful stops, so each successor leads at once (a killed
        leader's successor waits out its lease, which a timed measure would count)."""
        self._restart_operator(**DEPLOYED_OPERATOR_ENV, **env)
        yield  # a measure that raised ends the run: no restore to wait for, or to hide its error
        self._restart_operator(**DEPLOYED_OPERATOR_ENV)

    def _restart_operator(self, **env: str) -> None:
        self.operator.stop()
        self.operator.start(**env)
        self.operator.wait_leading()

    def close(self) -> None:
        self.operator.kill()
        self.ledger.close()
        self._api.close()
        self.markers.close()
        discard_namespace(self.rig.kubectl, self.namespace)
        if self.finalizer_binding:
            unbind_finalizer_policy(self.rig.kubectl, self.finalizer_binding)

    # -- what both sides run -----------------------------------------------------------------

    def marker_command(self, name: str, then: str = "") -> list[str]:
        """A command that records the moment it starts (host clock) under `name`."""
        return self.markers.command(name, then)

    def starts(self, name: str) -> list[float]:
        return self.markers.starts(name)

    def create_task(self, name: str, steps: list[dict[str, Any]], *, labels: dict[str, str] | None = None,
                    **spec: Any) -> str:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Task", "metadata": {"name": name, "labels": labels or {}},
                "spec": {"steps": steps, **spec}}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)["metadata"]["uid"]

    def create_job(self, name: str, command: list[str], *, backoff_limit: int = 0,
                   preferred_node: str | None = None, unreachable_toleration_seconds: int | None = None) -> None:
        """The bare Job a user would write instead: the same command, nothing else, in the image
        retex's steps run in (on kind loaded on the nodes, so no pull is timed; the rig has no images).
        `preferred_node` draws its pod to that node (a preference: its replacement may go elsewhere);
        `unreachable_toleration_seconds` replaces the default toleration of an unreachable node."""
        container = {"name": "main", "image": self.rig.worker_image, "command": command}
        pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
        if unreachable_toleration_seconds is not None:
            pod_spec["tolerations"] = [{"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                                        "effect": "NoExecute", "tolerationSeconds": unreachable_toleration_seconds}]
        if preferred_node:
            term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [preferred_node]}]}
            pod_spec["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "preference": term}]}}
        body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
                "spec": {"backoffLimit": backoff_limit,
                         "template": {"metadata": {"labels": {"bench": name}}, "spec": pod_spec}}}
        self.batch.create_namespaced_job(self.namespace, body)

    def jobs_finished(self, names: set[str]) -> int:
        jobs = self.batch.list_namespaced_job(self.namespace).items
        return sum(1 for j in jobs if j.metadata.name in names and (j.status.succeeded or j.status.failed))

    def jobs_finished_by_label(self, label: str) -> int:
        jobs = self.batch.list_namespaced_job(self.namespace, label_selector=label).items
        return sum(1 for j in jobs if j.status.succeeded or j.status.failed)

    def succeeded(self, uids: list[str]) -> int:
        """How many of these tasks the ledger shows Succeeded (one not admitted yet is not)."""
        with psycopg.connect(self.dsn) as conn:
            return conn.execute("SELECT count(*) FROM retex.tasks WHERE uid = ANY(%s) AND phase = 'Succeeded'",
                                (uids,)).fetchone()[0]

    def pods(self, selector: str) -> list[Any]:
        return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items

    def running_pods(self, selector: str) -> list[str]:
        return [p.metadata.name for p in self.pods(selector) if p.status.phase == "Running"]


# -- measures ------------------------------------------------------------------------------------


def measure_checkpoint(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """Steps/s of tasks of no-op exec steps against the physical floor: a single-row INSERT+COMMIT
    on the same Postgres (same durability) plus spawning a no-op process."""
    figures = []
    measured = sizes.checkpoint_steps - 1  # after the gate
    for parallel in dict.fromkeys((1, sizes.checkpoint_parallel)):  # once each, in that order
        # Not beside an earlier run's or round's clean-up (a namespace being deleted, Jobs ending):
        # one task stepping is bound by round trips, and any load slows it.
        quiet = _quiet_api_writes(system, sizes.quiet_timeout_seconds)
        names = {f"checkpoint-{parallel}-{i}" for i in range(parallel)}
        uids = [system.create_task(name, [{"name": "gate", "exec": {"command": system.markers.gate_command(name)},
                                           "idempotent": True}]
                                   + [{"name": f"s{i}", "exec": {"command": ["true"]}, "idempotent": True}
                                      for i in range(measured)])
                for name in sorted(names)]
        # Every worker started and waiting at its gate, then all open at once: the window times the
        # steps going on together, not the workers' starts spread over it.
        wait_for(f"{parallel} checkpoint task(s) at their gate", lambda: names <= system.markers.waiting(),  # noqa: B023 (called in the loop)
                 timeout=60 + 5 * parallel)
        with CpuAccount() as at_the_gates:  # the same processes, every worker waiting: the control
            time.sleep(GATE_CONTROL_SECONDS)
        requests_before = _api_requests(system, ALL_VERBS)
        with CpuAccount() as cpu:  # who spends the cores while they step: the kernel's counters
            system.markers.open_gates(names)
            wait_for(f"{parallel} checkpoint task(s) Succeeded", lambda: system.succeeded(uids) == len(uids),  # noqa: B023 (called in the loop)
                     timeout=60 + 2 * sizes.checkpoint_steps * parallel)
        requests = _counts_between(requests_before, _api_requests(system, ALL_VERBS))
        begins, commits, stepping, step_samples = [], [], 0.0, []
        for uid in uids:
            history = [h for h in system.ledger.history(uid) if h.step_idx is not None and h.step_idx > 0]  # 0: the gate
            own_begins = [h.at.timestamp() for h in history if h.event == "step-begin"]
            own_commits = [h.at.timestamp() for h in history if h.event == "step-commit"]
            stepping += max(own_commits) - min(own_begins)
            # A step's time within its task: from the previous step's commit (the first: its begin).
            ends = sorted(own_commits)
            step_samples += [b - a for a, b in itertools.pairwise([min(own_begins), *ends])]
            begins, commits = begins + own_begins, commits + own_commits
        window = max(commits) - min(begins)
        # The CPU of the stepping window alone (the snapshots around it: not the gates' opening
        # nor the tasks' ends), as cores, and as CPU time a step at the window's pace.
        stepping_cores = cpu.cores_between(min(begins), max(commits))
        busy, busy_at_the_gates = cpu.busy_cores_between(min(begins), max(commits)), at_the_gates.busy_cores_between()
        ms_per_step = {group: cores * window * 1000 / len(commits) for group, cores in stepping_cores.items()}
        retex_rate = len(commits) / window
        say(f"  {parallel} checkpoint task(s): {stepping / window:.1f} stepping at once on average over {window:.1f} s; "
            f"{busy:.2f} cores busy ({busy_at_the_gates:.2f} at the gates), CPU ms a step: "
            + ", ".join(f"{group} {ms:.1f}" for group, ms in ms_per_step.items()))
        commit_rate, commit_samples = _commit_loop_rate(system.postgres, measured, clients=parallel)
        spawn_seconds = _spawn_seconds(measured)
        step_seconds = parallel / retex_rate  # per step, per task
        floor = 1 / (commit_rate / parallel) + spawn_seconds
        figures.append(Figure(
            measure=f"checkpoint, {parallel} task(s) of {measured} no-op steps",
            unit="steps/s", retex=retex_rate, baseline=commit_rate, baseline_name=f"INSERT+COMMIT loop, {parallel} client(s)",
            ratio=step_seconds / floor, target="≤ 2× (commit + spawn) per step", met=step_seconds / floor <= 2.0,
            retex_samples=step_samples, baseline_samples=[c + spawn_seconds for c in commit_samples],
            samples_unit="s a step (within a task; the baseline: a commit + a spawn)", target_at=2 * floor,
            # How many tasks stepped at once on average: below `parallel` when their workers' starts
            # were spread over the window rather than their steps contending.
            detail={"retex_seconds_per_step": step_seconds, "commit_seconds": parallel / commit_rate,
                    "tasks_stepping_at_once": stepping / window,
                    "quiet_wait_seconds": quiet.waited,
                    "cpu_busy_cores": busy,
                    "cpu_busy_cores_at_the_gates": busy_at_the_gates,
                    "cpu_ms_per_step_by_group": _rounded(ms_per_step),
                    "cpu_cores_by_group": _rounded(stepping_cores),
                    "cpu_cores_by_group_at_the_gates": _rounded(at_the_gates.cores_between()),
                    # What the API server was asked from the gates' opening to all Succeeded, by every client.
                    "api_requests_in_window": dict(sorted(requests.items(), key=lambda item: -item[1])),
                    "spawn_seconds": spawn_seconds,
                    "commit_ratio_net_of_spawn": (parallel / commit_rate) / max(step_seconds - spawn_seconds, 1e-9)}))
    return figures


GATE_CONTROL_SECONDS = 3.0


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {key: round(value, 3) for key, value in values.items()}


def _commit_loop_rate(postgres: PostgresServer, rows: int, *, clients: int) -> tuple[float, list[float]]:
    """Commits/s of `clients` connections each committing `rows` single-row transactions, and each
    INSERT+COMMIT's seconds."""
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_commits (id bigserial PRIMARY KEY, v text)")
    samples: list[float] = []

    def loop() -> None:
        with psycopg.connect(postgres.dsn()) as conn:
            for i in range(rows):
                began = time.perf_counter()
                conn.execute("INSERT INTO bench_commits (v) VALUES (%s)", (str(i),))
                conn.commit()
                samples.append(time.perf_counter() - began)

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return rows * clients / (time.perf_counter() - started), samples


def _spawn_seconds(count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        subprocess.run(["true"], check=True)
    return (time.perf_counter() - started) / count


def measure_latency(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """Create → the command starts, for single-step tasks and for bare Jobs created one by one,
    alternating so both see the same load."""
    retex, jobs = [], []
    for i in range(sizes.latency_tasks):
        for kind, samples in (("task", retex), ("job", jobs)):
            name = f"latency-{kind}-{i}"
            created = time.time()
            if kind == "task":
                system.create_task(name, [{"name": "only", "exec": {"command": system.marker_command(name)}}])
            else:
                system.create_job(name, system.marker_command(name))
            wait_for(f"{name} started", lambda n=name: system.starts(n), timeout=60, interval=0.02)
            samples.append(system.starts(name)[0] - created)
    figures = []
    for q in (50, 95):
        r, b = percentile(retex, q), percentile(jobs, q)
        figures.append(Figure(measure=f"create → first step started, p{q}", unit="s", retex=r, baseline=b,
                              baseline_name="bare Job: create → container command started", ratio=r / b,
                              target="ratio ≤ 1.3", met=r / b <= 1.3, detail={"samples": len(retex)},
                              retex_samples=retex, baseline_samples=jobs, target_at=1.3 * b))
    return figures


def measure_throughput(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """Tasks/min of many 3-step no-op tasks created at once under a run limit, against as many bare
    Jobs running the same three commands with at most as many at once."""
    count, limit = sizes.throughput_tasks, sizes.throughput_limit
    steps = [{"name": f"s{i}", "exec": {"command": ["true"]}, "idempotent": True} for i in range(3)]
    with system.operator_with(RETEX_MAX_RUNNING=str(limit)):
        started = time.monotonic()
        uids = [system.create_task(f"throughput-{i}", steps) for i in range(count)]
        wait_for(f"{count} tasks Succeeded", lambda: system.succeeded(uids) == count, timeout=60 + 5 * count, interval=0.5)
        retex_rate = count / (time.monotonic() - started) * 60

    names = [f"throughput-job-{i}" for i in range(count)]
    started, created = time.monotonic(), 0
    while True:  # the limit a user would have to enforce themselves: at most `limit` unfinished
        finished = system.jobs_finished(set(names[:created]))
        if finished == count:
            break
        while created < count and created - finished < limit:
            system.create_job(names[created], ["sh", "-c", "true; true; true"])
            created += 1
        time.sleep(0.1)
    job_rate = count / (time.monotonic() - started) * 60
    return [Figure(measure=f"throughput, {count} 3-step tasks, at most {limit} at once", unit="tasks/min",
                   retex=retex_rate, baseline=job_rate, baseline_name="bare Jobs, same commands, same limit",
                   ratio=retex_rate / job_rate, target="≥ 0.8× bare Jobs", met=retex_rate / job_rate >= 0.8)]


def measure_recovery(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """The worker's processes SIGKILLed mid-step → the next attempt's step starts; against a bare
    Job (backoffLimit 1) whose pod is killed the same way → its replacement's command starts."""
    retex, jobs = [], []
    stages: list[dict[str, float]] = []
    timeline: list[tuple[float, str, str]] = []
    for i in range(sizes.recovery_runs):
        name = f"recovery-task-{i}"
        uid = system.create_task(name, [{"name": "only", "idempotent": True,
                                         "exec": {"command": system.marker_command(name, "sleep 30")}}],
                                 lease={"durationSeconds": LEASE_SECONDS})
        killed, restarted = _kill_and_time_restart(system, name, f"retex.dev/task-uid={uid}")
        retex.append(restarted)
        timeline = [event for event in _task_timeline(system, uid, killed) if event[0] >= 0]
        stages.append(_recovery_stages(timeline))
        system.custom.delete_namespaced_custom_object(GROUP, VERSION, system.namespace, PLURAL, name)
        name = f"recovery-job-{i}"
        system.create_job(name, system.marker_command(name, "sleep 30"), backoff_limit=1)
        jobs.append(_kill_and_time_restart(system, name, f"bench={name}")[1])
        system.batch.delete_namespaced_job(name, system.namespace, propagation_policy="Background")
    r, b = percentile(retex, 95), percentile(jobs, 95)
    stage_figures = {label: {"p50": percentile(found, 50), "p95": percentile(found, 95), "samples": len(found)}
                     for label, _, _ in RECOVERY_STAGES
                     if (found := [sample[label] for sample in stages if label in sample])}
    say("  recovery stages, seconds from the kill to each (p50 / p95 over the samples):")
    for label, figure in stage_figures.items():
        say(f"    {figure['p50']:6.2f} / {figure['p95']:6.2f}  {label} ({figure['samples']} samples)")
    say(f"  timeline of the last recovery (seconds from the kill; {len(timeline)} events):")
    for offset, source, what in timeline:
        say(f"    {offset:7.3f}  {source:8}  {what}")
    # A death the kubelet reports is not waited for (its target: ≤ 3 s); lease + 5 s is for silent ones.
    bound = OBSERVED_DEATH_TARGET_SECONDS
    return [Figure(measure="recovery from a worker SIGKILLed mid-step, p95", unit="s", retex=r, baseline=b,
                   baseline_name="bare Job, backoffLimit 1: pod killed → replacement started", ratio=r / b,
                   target=f"≤ {bound} s (an observed death)", met=r <= bound,
                   detail={"lease_seconds": LEASE_SECONDS, "retex_p50": percentile(retex, 50),
                           "job_p50": percentile(jobs, 50), "samples": len(retex), "stages": stage_figures,
                           "timeline": [list(t) for t in timeline]},
                   retex_samples=retex, baseline_samples=jobs, target_at=bound)]


def measure_node_loss(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """A node lost mid-step (its agent and every pod SIGKILLed, nothing reported: a silent loss) →
    the next attempt's step starts on another node; against a bare Job (backoffLimit 1) whose pod
    ran on the same node, lost in the same kill → its replacement's command starts. The retex side
    waits for the lease to expire; the Job's for the node to turn unreachable and its pod's
    toleration of that to run out (the cluster's own settings, recorded beside the figure)."""
    job_toleration = sizes.node_loss_job_toleration_seconds or None  # 0: the cluster's default
    samples = [_lose_a_node(system, f"node-loss-task-{i}", f"node-loss-job-{i}", job_toleration)
               for i in range(sizes.node_loss_runs)]
    retex, jobs = [r for r, _ in samples], [j for _, j in samples]
    r, b = percentile(retex, 95), percentile(jobs, 95)
    bound = LEASE_SECONDS + 5
    node_timing = asdict(system.rig.timing) if isinstance(system.rig, Rig) else "the cluster's own"
    return [Figure(measure="recovery from a lost node (agent and pods SIGKILLed), p95", unit="s", retex=r, baseline=b,
                   baseline_name="bare Job, backoffLimit 1, on the same node: replacement started", ratio=r / b,
                   target=f"≤ lease + 5 s = {bound} s (a silent loss)", met=r <= bound,
                   detail={"lease_seconds": LEASE_SECONDS, "node_loss_timing": node_timing,
                           "job_unreachable_toleration_seconds": job_toleration or "the cluster's default",
                           "retex_p50": percentile(retex, 50), "job_p50": percentile(jobs, 50)},
                   retex_samples=retex, baseline_samples=jobs, target_at=bound)]


def _lose_a_node(system: BenchSystem, task: str, job: str, job_toleration: int | None) -> tuple[float, float]:
    """Seconds from one node's loss to the next start of `task`'s step and of `job`'s command,
    both running on that node when it was lost."""
    # Both commands outlast the waits before the kill by far: each must still run when the node goes.
    uid = system.create_task(task, [{"name": "only", "idempotent": True,
                                     "exec": {"command": system.marker_command(task, "sleep 600")}}],
                             lease={"durationSeconds": LEASE_SECONDS})
    wait_for(f"{task} started", lambda: system.starts(task), timeout=60, interval=0.05)
    node = _running_pod_node(system, f"retex.dev/task-uid={uid}")
    system.create_job(job, system.marker_command(job, "sleep 600"), backoff_limit=1, preferred_node=node,
                      unreachable_toleration_seconds=job_toleration)
    wait_for(f"{job} started", lambda: system.starts(job), timeout=60, interval=0.05)
    if (job_node := _running_pod_node(system, f"bench={job}")) != node:
        raise RuntimeError(f"{job}'s pod runs on {job_node}, not on {node} with {task}'s: not the same loss")
    killed = time.time()
    try:
        system.rig.kill_node(node)
        wait_for(f"{task} started again", lambda: len(system.starts(task)) > 1,
                 timeout=LEASE_SECONDS + 60, interval=0.05)
        wait_for(f"{job} started again", lambda: len(system.starts(job)) > 1, timeout=NODE_LOSS_JOB_TIMEOUT, interval=0.1)
    finally:
        system.rig.restart_node(node)
    retex, job_took = system.starts(task)[1] - killed, system.starts(job)[1] - killed
    say(f"  lost {node}: retex's next step after {retex:.2f} s, the bare Job's replacement after {job_took:.2f} s")
    system.custom.delete_namespaced_custom_object(GROUP, VERSION, system.namespace, PLURAL, task)
    system.batch.delete_namespaced_job(job, system.namespace, propagation_policy="Background")
    return retex, job_took


def _running_pod_node(system: BenchSystem, selector: str) -> str:
    pods = wait_for(f"a running pod of {selector}",
                    lambda: [p for p in system.pods(selector) if p.status.phase == "Running"], timeout=30)
    return pods[0].spec.node_name


# What happens between a worker's kill and its task's next step, in order: (label, source, the
# first event of that source after the kill whose text starts so), from _task_timeline.
RECOVERY_STAGES = (
    ("the operator's pod watch saw the pod fail", "operator", "worker pod failed"),
    ("the reaper's verdict", "operator", "lease holder's pod terminated"),
    ("the next attempt recorded", "ledger", TaskEvent.REPLACE_ATTEMPT.value),
    ("its Job created", "operator", "attempt dispatched"),
    ("its worker's process started", "worker", WORKER_PROCESS_STARTED),
    ("its worker's first log line (imports done)", "worker", "worker started"),
    ("its Lease held", "worker", "lease acquired"),
    ("its step begun", "ledger", "step-begin"),
)


def _recovery_stages(timeline: list[tuple[float, str, str]]) -> dict[str, float]:
    """Seconds from the kill to each stage found in one recovery's timeline (the step's command
    starting is the measure itself)."""
    found = {}
    for label, source, text in RECOVERY_STAGES:
        at = next((offset for offset, s, what in timeline if s == source and what.startswith(text)), None)
        if at is not None:
            found[label] = at
    return found


PROFILE_STEPS = 3


def measure_profile(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """Where the time goes for one no-op 3-step task, create → Succeeded: its timeline merged from
    the ledger's history, the operator's log, the rig agent's log (container started) and the
    worker's own log, printed for the last task; against a bare Job running `true; true; true`,
    create → Complete, alternating."""
    retex, jobs = [], []
    steps = [{"name": f"s{i}", "exec": {"command": ["true"]}, "idempotent": True} for i in range(PROFILE_STEPS)]
    timeline: list[tuple[float, str, str]] = []
    for i in range(sizes.profile_tasks):
        name = f"profile-task-{i}"
        created = time.time()
        uid = system.create_task(name, steps)
        wait_for(f"{name} Succeeded", lambda u=uid: system.succeeded([u]), timeout=120, interval=0.02)
        retex.append(time.time() - created)
        timeline = _task_timeline(system, uid, created)
        name = f"profile-job-{i}"
        created = time.time()
        system.create_job(name, ["sh", "-c", "true; true; true"])
        wait_for(f"{name} Complete", lambda n=name: system.jobs_finished({n}), timeout=120, interval=0.02)
        jobs.append(time.time() - created)
    say(f"  timeline of the last task (seconds from create; {len(timeline)} events):")
    for offset, source, what in timeline:
        say(f"    {offset:7.3f}  {source:8}  {what}")
    r, b = percentile(retex, 50), percentile(jobs, 50)
    return [Figure(measure=f"profile, create → Succeeded of a no-op {PROFILE_STEPS}-step task, p50", unit="s",
                   retex=r, baseline=b, baseline_name="bare Job `true; true; true`: create → Complete",
                   ratio=r / b, target="reported (where the time goes)", met=True,
                   detail={"samples": len(retex), "timeline": [list(t) for t in timeline],
                           "timeline_sources": sorted({source for _, source, _ in timeline})},
                   retex_samples=retex, baseline_samples=jobs)]


def _task_timeline(system: BenchSystem, uid: str, created: float) -> list[tuple[float, str, str]]:
    events = [(h.at.timestamp(), "ledger", h.event + (f" step {h.step_idx}" if h.step_idx is not None else ""))
              for h in system.ledger.history(uid)]
    for line in _lines_with(system.operator_log, uid):
        events.append((_iso_seconds(line["ts"]), "operator", line["msg"]))
    for pod in (p.metadata.name for p in system.pods(f"retex.dev/task-uid={uid}")):
        try:
            lines = _json_lines_with(system.rig.pod_log(system.namespace, pod, "worker"), uid)
        except subprocess.CalledProcessError as exc:  # a pod being deleted with its Job: its log is gone
            say(f"  {pod}: its log is not readable ({(exc.stderr or '').strip()[:200]}); left out of the timeline")
            continue
        events += [(_iso_seconds(line["ts"]), "worker", line["msg"]) for line in lines]
        events += [(_iso_seconds(line["ts"]) - line["process_age_seconds"], "worker", WORKER_PROCESS_STARTED)
                   for line in lines if line.get("process_age_seconds") is not None]
        if lines and system.rig.state_dir is not None:  # the rig's node agents log when a container started
            for agent_log in system.rig.state_dir.glob("logs/*.log"):
                for text in agent_log.read_text(errors="replace").splitlines():
                    if f"/{pod} container worker " in text:
                        stamp = datetime.strptime(text[:23], "%Y-%m-%d %H:%M:%S,%f").astimezone()
                        events.append((stamp.timestamp(), "agent", text[text.index("container"):][:60]))
    return sorted((at - created, source, what) for at, source, what in events)


def _lines_with(path: Path, uid: str) -> list[dict[str, Any]]:
    """The JSON log lines of `path` that name the task `uid`."""
    return _json_lines_with(path.read_text(errors="replace"), uid) if path.exists() else []


def _json_lines_with(log: str, uid: str) -> list[dict[str, Any]]:
    found = []
    for text in log.splitlines():
        if uid in text and text.startswith("{"):
            try:
                found.append(json.loads(text))
            except ValueError:
                continue
    return found


def _iso_seconds(stamp: str) -> float:
    return datetime.fromisoformat(re.sub(r"Z$", "+00:00", stamp)).timestamp()


WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "APPLY"})
ALL_VERBS = WRITE_VERBS | {"GET", "LIST", "WATCH"}
# Written all along, whatever runs: the node agents' status and the control plane's own elections.
BACKGROUND_RESOURCES = frozenset({"nodes", "leases"})
WRITES_STEPS = 5
DRY_RUN = " (dry run)"  # validated and admitted, never stored: reported, not counted as a write


def measure_writes(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """Writes to the API server (its own request counters; dry runs apart) per 5-step no-op task,
    against a bare Job running the same five commands: everything written while they run, by every client (the
    Job controller's and the scheduler's writes for retex's Job are there too, so retex's own are
    about the difference). Lease writes are counted apart: retex's renewals and the control plane's
    elections both land there."""
    count = sizes.writes_tasks
    steps = [{"name": f"s{i}", "exec": {"command": ["true"]}, "idempotent": True} for i in range(WRITES_STEPS)]
    quiet_before_tasks = before = _quiet_api_writes(system, sizes.quiet_timeout_seconds)
    uids = [system.create_task(f"writes-task-{i}", steps) for i in range(count)]
    wait_for(f"{count} tasks Succeeded", lambda: system.succeeded(uids) == count, timeout=60 + 10 * count, interval=0.5)
    wait_for("their Jobs complete", lambda: system.jobs_finished_by_label("retex.dev/task-uid") >= count, timeout=60)
    # Closed once the status mirror's last patch and the Job controller's last status are in.
    after = _quiet_api_writes(system, sizes.quiet_timeout_seconds)
    retex_writes = _counts_between(before.writes, after.writes)
    before = after
    names = {f"writes-job-{i}" for i in range(count)}
    for name in names:
        system.create_job(name, ["sh", "-c", "; ".join(["true"] * WRITES_STEPS)])
    wait_for(f"{count} Jobs complete", lambda: system.jobs_finished(names) == count, timeout=60 + 10 * count, interval=0.5)
    after = _quiet_api_writes(system, sizes.quiet_timeout_seconds)
    job_writes = _counts_between(before.writes, after.writes)

    def per_task(writes: dict[str, int], *, leases: bool) -> float:
        return sum(n for key, n in writes.items()
                   if not key.endswith(DRY_RUN) and (key.split("/")[0] in BACKGROUND_RESOURCES) == leases) / count

    r, b = per_task(retex_writes, leases=False), per_task(job_writes, leases=False)
    own = r - b
    waits = [quiet_before_tasks.waited, before.waited, after.waited]
    quiet = None not in waits  # else a window held someone else's writes: a count, not a figure to judge
    return [Figure(measure=f"API server writes per {WRITES_STEPS}-step task, leases and nodes apart", unit="writes",
                   retex=r, baseline=b, baseline_name=f"bare Job running {WRITES_STEPS} commands", ratio=r / b,
                   target="retex's own (the difference) ≤ 12", met=own <= 12 if quiet else None,
                   detail={"retex_own_per_task": own, "tasks": count,
                           # Seconds each window waited at its edges for the cluster to stop writing
                           # (None: it never did, and the counts hold someone else's writes).
                           "quiet_waits_seconds": waits,
                           "lease_and_node_writes_per_task": per_task(retex_writes, leases=True),
                           "lease_and_node_writes_per_job": per_task(job_writes, leases=True),
                           "retex_by_resource": {k: v / count for k, v in sorted(retex_writes.items())},
                           "job_by_resource": {k: v / count for k, v in sorted(job_writes.items())}})]


def _api_requests(system: BenchSystem, verbs: frozenset[str] = WRITE_VERBS) -> dict[str, int]:
    """The API server's requests so far with these verbs (writes unless told), by `resource/subresource verb`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = system.rig.kubectl("get", "--raw", "/metrics").stdout
    writes: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            labels = sample.labels
            if sample.name != "apiserver_request_total" or labels.get("verb") not in verbs:
                continue
            key = f"{labels.get('resource')}/{labels.get('subresource') or ''} {labels['verb']}"
            key += DRY_RUN if labels.get("dry_run") else ""
            writes[key] = writes.get(key, 0) + int(sample.value)
    return writes


@dataclass(frozen=True)
class QuietWrites:
    writes: dict[str, int]
    waited: float | None  # None: the writes never stopped within the timeout


QUIET_SECONDS = 3.0


def _quiet_api_writes(system: BenchSystem, timeout: float) -> QuietWrites:
    """The write counters once nothing but leases and node status has been written for
    QUIET_SECONDS and no namespace is being deleted: a window opened or closed there holds only
    its own side's writes (not an earlier measure's clean-up, nor the tail of its own work)."""
    started = time.monotonic()
    last = _api_requests(system)
    while time.monotonic() - started < timeout:
        time.sleep(QUIET_SECONDS)
        now = _api_requests(system)
        moved = [key for key in _counts_between(last, now) if key.split("/")[0] not in BACKGROUND_RESOURCES]
        terminating = [ns.metadata.name for ns in system.core.list_namespace().items if ns.status.phase == "Terminating"]
        if not moved and not terminating:
            return QuietWrites(now, time.monotonic() - started)
        last = now
    say(f"  the API server never went quiet in {timeout:.0f} s: these writes hold others'")
    return QuietWrites(last, None)


def _counts_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: n - before.get(key, 0) for key, n in after.items() if n > before.get(key, 0)}


LEDGER_STEPS = 5  # the growth per step is the difference between tasks of this many steps and of one


def measure_ledger(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """Ledger growth: bytes on disk per finished task and per step, tasks driven through the ledger
    in process (admit, begin and commit each step, complete: what operator and worker write) on a
    database of its own; then the purge of all of them, against a plain DELETE of as many rows."""
    count = sizes.ledger_tasks
    database = f"bench_ledger_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(system.postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    dsn = system.postgres.dsn(dbname=database)
    with Ledger(dsn) as ledger:
        empty = sum(_ledger_bytes(dsn).values())
        spec_bytes = 0
        grown: dict[int, float] = {}
        by_table: dict[str, float] = {}
        for steps in (1, LEDGER_STEPS):
            before = _ledger_bytes(dsn)
            for i in range(count):
                spec = {"steps": [{"name": f"s{j}", "exec": {"command": ["sh", "-c", f"echo {j}"]}} for j in range(steps)]}
                spec_bytes = len(json.dumps(spec))
                uid = ledger.admit(TaskAdmission(uid=str(uuid.uuid4()), namespace="bench", name=f"g{steps}-{i}",
                                                 spec=spec, step_names=[f"s{j}" for j in range(steps)])).uid
                record = ledger.get(uid)
                for j in range(steps):
                    ledger.begin_step(record.uid, record.epoch, j, actor="worker")
                    ledger.commit_step(record.uid, record.epoch, j, {"out": f"{j}\n"}, actor="worker")
                ledger.complete_task(record.uid, record.epoch, actor="worker")
            after = _ledger_bytes(dsn)
            by_table = {table: (size - before.get(table, 0)) / count for table, size in after.items()}
            grown[steps] = sum(by_table.values())
            say(f"  {count} finished tasks of {steps} step(s): {grown[steps]:.0f} bytes each")
        per_step = (grown[LEDGER_STEPS] - grown[1]) / (LEDGER_STEPS - 1)
        time.sleep(0.01)
        started = time.perf_counter()
        purged = ledger.purge_finished(older_than_seconds=0)
        purge_seconds = time.perf_counter() - started
        after_purge = sum(_ledger_bytes(dsn).values())
    delete_seconds = _plain_delete_seconds(system.postgres, purged)
    with psycopg.connect(system.postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {database}")
    # What the API server keeps of the same task: its spec (a Task object is that plus metadata).
    return [
        Figure(measure=f"ledger growth per finished {LEDGER_STEPS}-step task", unit="bytes",
               retex=grown[LEDGER_STEPS], baseline=spec_bytes, baseline_name="the task's spec as JSON",
               ratio=grown[LEDGER_STEPS] / spec_bytes, target="reported", met=True,
               detail={"bytes_per_step": per_step, "bytes_per_one_step_task": grown[1], "tasks": count,
                       "empty_ledger_bytes": empty, "bytes_per_task_by_table": by_table}),
        Figure(measure=f"purge of {purged} finished tasks", unit="s", retex=purge_seconds, baseline=delete_seconds,
               baseline_name=f"DELETE of {purged} rows of a plain table", ratio=purge_seconds / delete_seconds,
               target="reported", met=True,
               detail={"tasks_purged": purged, "bytes_left_after_purge": after_purge - empty,
                       "note": "space is reused after VACUUM, not returned: the files do not shrink"}),
    ]


def _ledger_bytes(dsn: str) -> dict[str, int]:
    """Each table of the retex schema on disk with its indexes and TOAST, after a VACUUM so dead
    rows do not count."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM")
        rows = conn.execute("SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
                            "JOIN pg_namespace n ON n.oid = c.relnamespace "
                            "WHERE n.nspname = 'retex' AND c.relkind = 'r'").fetchall()
        return {name: int(size) for name, size in rows}


def _plain_delete_seconds(postgres: PostgresServer, rows: int) -> float:
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_purge")
        conn.execute("CREATE TABLE bench_purge (id bigserial PRIMARY KEY, v text)")
        conn.execute("INSERT INTO bench_purge (v) SELECT md5(g::text) FROM generate_series(1, %s) g", (rows,))
        started = time.perf_counter()
        conn.execute("DELETE FROM bench_purge")
        seconds = time.perf_counter() - started
        conn.execute("DROP TABLE bench_purge")
        return seconds


SCALE_LABELS = {"bench": "scale"}
SCALE_SELECTOR = "bench=scale"
SCALE_NOT_BEFORE = "2099-01-01T00:00:00Z"  # far enough that none of the delayed Tasks comes due
SCALE_CREATE_THREADS = 4
SCALE_RSS_TARGET_MB = 300.0
SCALE_ADMISSION_TARGET_SECONDS = 300.0
SCALE_LAG_TARGET_SECONDS = 2.0
TASK_PHASES = frozenset(TaskPhase)


class OperatorRss:
    """The operator's resident memory (VmRSS of its process), sampled every half second on a thread."""

    def __init__(self, operator: OperatorProcess):
        self.operator = operator
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def now_mb(self) -> float:
        assert self.operator.proc is not None
        status = Path(f"/proc/{self.operator.proc.pid}/status").read_text()
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        assert found is not None, status
        return int(found[1]) / 1024

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(0.5):
            self.peak_mb = max(self.peak_mb, self.now_mb())

    def __enter__(self) -> OperatorRss:
        self.peak_mb = self.now_mb()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


class PhaseWatch:
    """A watch on the Tasks labelled `selector` on a thread of its own: when each was first seen
    (ADDED) and when each new status.phase arrived, host clock."""

    def __init__(self, system: BenchSystem, selector: str):
        self._api = system.rig.api_client()
        self._list = client.CustomObjectsApi(self._api).list_namespaced_custom_object
        self._where = (GROUP, VERSION, system.namespace, PLURAL)
        self._selector = selector
        self.added: dict[str, float] = {}
        self.phases: dict[str, list[tuple[float, str]]] = {}
        self._watch = watch.Watch()
        self._stopping = False
        self._failure: Exception | None = None
        listed = self._list(*self._where, label_selector=selector)
        self._thread = threading.Thread(target=self._follow, args=(listed["metadata"]["resourceVersion"],), daemon=True)

    def _follow(self, resource_version: str) -> None:
        try:
            # The client's own method (not a wrapper): its doc tells the watch the answer's type, and
            # only then does the watch follow resourceVersion, to reconnect where it left off.
            for event in self._watch.stream(self._list, *self._where, label_selector=self._selector,
                                            resource_version=resource_version, allow_watch_bookmarks=True):
                if event["type"] == "BOOKMARK":
                    continue
                seen, task = time.time(), event["object"]
                uid = task["metadata"]["uid"]
                self.added.setdefault(uid, seen)
                phase = (task.get("status") or {}).get("phase")
                shown = self.phases.setdefault(uid, [])
                if phase and (not shown or shown[-1][1] != phase):
                    shown.append((seen, phase))
        except Exception as exc:  # closing the client ends the stream too: only a failure before counts
            if not self._stopping:
                self._failure = exc

    def shown(self, uids: list[str], phase: str | None = None) -> int:
        """How many of `uids` have shown a phase (`phase`, when given) so far."""
        if self._failure is not None:
            raise RuntimeError(f"the watch on the Tasks failed: {self._failure!r}") from self._failure
        return sum(1 for uid in uids if any(phase in (None, p) for _, p in self.phases.get(uid, ())))

    def __enter__(self) -> PhaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopping = True
        self._watch.stop()
        self._api.close()


def measure_scale(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """The operator under a backlog: `scale_tasks` Tasks, all but `scale_runnable` delayed by a
    notBefore far ahead, the runnable ones (a no-op step each) created last. Its peak RSS (against
    its RSS at idle before), first create → every Task admitted in the ledger (against creating
    them), and for the runnable ones each phase change in the ledger → the Task's status showing
    it, as a watch sees it (against the watch's own delay: create → ADDED seen).

    The workers run on the machine's last core only (`workers_cpus`): on a cluster they run on
    other nodes than the operator, and on the rig 50 workers starting at once starved the operator
    of CPU (docs/benchmarks.md, "Operator at scale")."""
    all_cpus = os.sched_getaffinity(0)
    workers_cpus = {max(all_cpus)} if len(all_cpus) > 1 else all_cpus
    try:
        system.rig.confine_nodes(workers_cpus)
        return _measure_scale(system, sizes, workers_cpus)
    finally:
        system.rig.release_nodes()


def _measure_scale(system: BenchSystem, sizes: Sizes, workers_cpus: set[int]) -> list[Figure]:
    total, runnable = sizes.scale_tasks, sizes.scale_runnable
    wait_for("the operator ready", lambda: system.operator.probe("/readyz")[0] == 200, timeout=60)
    time.sleep(2)  # its start-up's last allocations: idle means nothing left to do
    step = [{"name": "only", "exec": {"command": ["true"]}, "idempotent": True}]
    with OperatorRss(system.operator) as rss, PhaseWatch(system, SCALE_SELECTOR) as watched:
        idle_mb = rss.peak_mb
        started = time.time()

        def create_delayed(i: int) -> str:
            if i % 500 == 0:
                say(f"  creating delayed Task {i} of {total - runnable}")
            return system.create_task(f"scale-delayed-{i}", step, labels=SCALE_LABELS, notBefore=SCALE_NOT_BEFORE)

        with ThreadPoolExecutor(SCALE_CREATE_THREADS) as pool:
            uids = list(pool.map(create_delayed, range(total - runnable)))
        created_at: dict[str, float] = {}
        for i in range(runnable):
            created = time.time()
            uid = system.create_task(f"scale-runnable-{i}", step, labels=SCALE_LABELS)
            created_at[uid] = created
        runnable_uids = list(created_at)
        uids += runnable_uids
        creation_seconds = time.time() - started
        say(f"  {total} Tasks created in {creation_seconds:.0f} s (operator RSS {rss.now_mb():.0f} MB)")

        def admitted() -> tuple[bool, str]:
            count = _admitted(system, uids)
            return count == total, f"{count}/{total} admitted, operator RSS {rss.now_mb():.0f} MB"

        wait_for(f"{total} Tasks admitted", admitted, timeout=120 + 0.3 * total, interval=1)
        admission_seconds = _last_admitted_at(system, uids) - started
        wait_for(f"{runnable} runnable Tasks Succeeded", lambda: system.succeeded(runnable_uids) == runnable,
                 timeout=120 + 2 * runnable, interval=0.5)
        wait_for(f"the status of {runnable} runnable Tasks showing Succeeded",
                 lambda: watched.shown(runnable_uids, TaskPhase.SUCCEEDED) == runnable, timeout=120 + 0.1 * total)
        wait_for(f"the status of {total} Tasks showing a phase", lambda: (watched.shown(uids) == total,
                 f"{watched.shown(uids)}/{total}"), timeout=120 + 0.1 * total, interval=1)
        statuses_seconds = max(watched.phases[uid][0][0] for uid in uids) - started
        lags, unshown, slowest = [], 0, []
        for uid in runnable_uids:
            changes = _ledger_phases(system, uid)
            shown = _status_lags(changes, watched.phases[uid])
            lags += [lag for lag in shown if lag is not None]
            unshown += shown.count(None)
            # When each slow one happened, to set beside the operator's log.
            slowest += [{"at_seconds": round(at - started, 2), "phase": phase, "lag": round(lag, 2)}
                        for (at, phase), lag in zip(changes, shown, strict=True) if lag is not None]
        watch_delays = [watched.added[uid] - created_at[uid] for uid in runnable_uids]
        say(f"  status lag p99 {percentile(lags, 99):.2f} s, every status shown after {statuses_seconds:.0f} s, "
            f"peak RSS {rss.peak_mb:.0f} MB, admission {admission_seconds:.0f} s; deleting the Tasks")
        deletion_seconds = _delete_labelled_tasks(system, SCALE_SELECTOR, total)
    lag = {q: percentile(lags, q) for q in (50, 95, 99)}
    name = f"scale, {total} Tasks ({runnable} runnable)"
    return [
        Figure(measure=f"{name}: operator peak RSS", unit="MB", retex=rss.peak_mb, baseline=idle_mb,
               baseline_name="the operator's RSS at idle, before the Tasks", ratio=rss.peak_mb / idle_mb,
               target=f"peak ≤ {SCALE_RSS_TARGET_MB:.0f} MB", met=rss.peak_mb <= SCALE_RSS_TARGET_MB,
               detail={"sampled_every_seconds": 0.5}),
        Figure(measure=f"{name}: first create → every Task admitted (ledger)", unit="s", retex=admission_seconds,
               baseline=creation_seconds,
               baseline_name=f"creating them: first create → last answered ({SCALE_CREATE_THREADS} threads)",
               ratio=admission_seconds / creation_seconds, target=f"≤ {SCALE_ADMISSION_TARGET_SECONDS:.0f} s",
               met=admission_seconds <= SCALE_ADMISSION_TARGET_SECONDS,
               detail={"every_status_showing_a_phase_seconds": statuses_seconds, "deletion_seconds": deletion_seconds}),
        Figure(measure=f"{name}: ledger phase change → Task status, p99", unit="s", retex=lag[99],
               baseline=percentile(watch_delays, 99), baseline_name="the watch itself: create → ADDED seen, p99",
               ratio=lag[99] / percentile(watch_delays, 99), target=f"≤ {SCALE_LAG_TARGET_SECONDS:g} s",
               met=lag[99] <= SCALE_LAG_TARGET_SECONDS,
               detail={"p50": lag[50], "p95": lag[95], "max": max(lags), "phase_changes": len(lags),
                       "never_shown": unshown, "watch_p50": percentile(watch_delays, 50),
                       "slowest": sorted(slowest, key=lambda change: -change["lag"])[:5],
                       "workers_cpus": sorted(workers_cpus)},
               retex_samples=lags, baseline_samples=watch_delays, target_at=SCALE_LAG_TARGET_SECONDS),
    ]


def _admitted(system: BenchSystem, uids: list[str]) -> int:
    with psycopg.connect(system.dsn) as conn:
        return conn.execute("SELECT count(*) FROM retex.tasks WHERE uid = ANY(%s)", (uids,)).fetchone()[0]


def _last_admitted_at(system: BenchSystem, uids: list[str]) -> float:
    with psycopg.connect(system.dsn) as conn:
        return conn.execute("SELECT max(at) FROM retex.history WHERE event = 'admit' AND task_uid = ANY(%s)",
                            (uids,)).fetchone()[0].timestamp()


def _ledger_phases(system: BenchSystem, uid: str) -> list[tuple[float, str]]:
    """The task's phase changes in the ledger's history (its steps' changes left out), ledger clock."""
    return [(h.at.timestamp(), h.to_state) for h in system.ledger.history(uid) if h.to_state in TASK_PHASES]


def _status_lags(changes: list[tuple[float, str]], shown: list[tuple[float, str]]) -> list[float | None]:
    """For each phase change in the ledger, the time until the status showed it or a later one
    (the mirror writes the ledger as it is when it gets to it: phases passed in between are never
    shown); None for a change never shown."""
    lags: list[float | None] = []
    j = 0
    for i, (at, _) in enumerate(changes):
        reached = {phase for _, phase in changes[i:]}
        while j < len(shown) and shown[j][1] not in reached:
            j += 1
        lags.append(shown[j][0] - at if j < len(shown) else None)
    return lags


def _delete_labelled_tasks(system: BenchSystem, selector: str, count: int) -> float:
    """Delete the Tasks labelled `selector` in one call and wait until the operator has let them
    all go (its finalizer): how long that took."""
    started = time.time()
    # A loaded server gives up on a long deletecollection part way (504, or 500 "etcdserver: request
    # timed out" on kind): the rest goes next time.
    for attempt in itertools.count(1):
        try:
            system.custom.delete_collection_namespaced_custom_object(GROUP, VERSION, system.namespace, PLURAL,
                                                                     label_selector=selector)
            break
        except client.exceptions.ApiException as exc:
            if exc.status < 500 or attempt == DELETE_COLLECTION_TRIES:
                raise
            say(f"  deleting the Tasks failed on the API server ({exc.status} {exc.reason}): asking again for the rest")
            time.sleep(attempt)

    def gone() -> tuple[bool, str]:
        page = system.custom.list_namespaced_custom_object(GROUP, VERSION, system.namespace, PLURAL,
                                                           label_selector=selector, limit=1)
        left = len(page["items"]) + (page["metadata"].get("remainingItemCount") or 0)
        return left == 0, f"{left} left"

    wait_for(f"{count} Tasks deleted", gone, timeout=120 + 0.2 * count, interval=1)
    return time.time() - started


def _kill_and_time_restart(system: BenchSystem, name: str, selector: str) -> tuple[float, float]:
    """When the pod was killed (host clock), and how long until the command started again."""
    wait_for(f"{name} started", lambda: system.starts(name), timeout=60, interval=0.05)
    pods = wait_for(f"{name}'s pod running", lambda: system.running_pods(selector), timeout=30)
    killed = time.time()
    system.rig.kill_pod(system.namespace, pods[0])
    wait_for(f"{name} started again", lambda: len(system.starts(name)) > 1, timeout=120, interval=0.05)
    return killed, system.starts(name)[1] - killed


# In the order they run, whatever order they are asked in. `writes` first: every Job retex runs is
# deleted its TTL (600 s) after it ends, and an earlier measure's Jobs being deleted one by one
# would keep the writes measure's windows from ever going quiet (seen: 120 s of them, after
# `throughput`'s 300).
NEIGHBOUR_TARGET = 2.0
NEIGHBOUR_RUN_LIMIT = 10


def measure_noisy_neighbour(system: BenchSystem, sizes: Sizes) -> list[Figure]:
    """A victim tenant's create → first step p95 while a hostile tenant makes every attack it
    can (e2e.neighbours: the endpoint flooded, stalled and read slowly, a start_run loop, decoy
    pods, a create/delete loop, top-priority tasks under a run limit), against the same victim
    run without the attack just before."""
    hostile = f"{system.namespace}-hostile"
    who = Neighbours(victim=system.namespace, hostile=hostile, user=f"{hostile}-user",
                     victim_tasks=sizes.neighbour_victim_tasks, greedy_tasks=sizes.neighbour_greedy_tasks)
    prepare_hostile_namespace(system.rig.kubectl, hostile, who.user, max_running=NEIGHBOUR_RUN_LIMIT // 2)
    env = {"RETEX_NAMESPACES": f"{system.namespace},{hostile}", "RETEX_MAX_RUNNING": str(NEIGHBOUR_RUN_LIMIT)}

    def restart_operator() -> None:
        system.operator.restart(**DEPLOYED_OPERATOR_ENV, **env)
        system.operator.wait_leading()

    def operator_pid() -> int:
        assert system.operator.proc is not None
        return system.operator.proc.pid

    try:
        with system.operator_with(**env):
            outcome = run_scenario(who, rig=system.rig, ledger=system.ledger, operator_pid=operator_pid,
                                   restart_operator=restart_operator, endpoint_port=system.operator.ledger_port,
                                   ca_file=str(system.operator.ledger_tls.ca_crt), workdir=system.workdir)
    finally:
        discard_namespace(system.rig.kubectl, hostile)
    attacked, calm = p95(outcome.attacked.first_step), p95(outcome.calm.first_step)
    return [Figure(measure="victim's create → first step p95 beside a hostile tenant", unit="s",
                   retex=attacked, baseline=calm, baseline_name="the same victim run with no hostile tenant",
                   ratio=outcome.ratio, target=f"ratio ≤ {NEIGHBOUR_TARGET:g}", met=outcome.ratio <= NEIGHBOUR_TARGET,
                   detail={"samples": len(outcome.attacked.first_step), "attacks": outcome.attacks,
                           "decoy_pods": outcome.decoys, "p95_by_stage": {"calm": outcome.calm.stages,
                                                                          "attacked": outcome.attacked.stages},
                           "operator_memory_mib": {k: round(v / 2**20) for k, v in outcome.memory.items()}},
                   retex_samples=outcome.attacked.first_step, baseline_samples=outcome.calm.first_step,
                   target_at=NEIGHBOUR_TARGET * calm)]


MEASURES: dict[str, Callable[[BenchSystem, Sizes], list[Figure]]] = {
    "writes": measure_writes,
    "checkpoint": measure_checkpoint,
    "latency": measure_latency,
    "throughput": measure_throughput,
    "recovery": measure_recovery,
    "node-loss": measure_node_loss,
    "profile": measure_profile,
    "ledger": measure_ledger,
    "scale": measure_scale,
    "noisy-neighbour": measure_noisy_neighbour,
}


def in_run_order(asked: list[str]) -> list[str]:
    """The measures asked for (all when none), in MEASURES' order."""
    return [name for name in MEASURES if not asked or name in asked]


def measure(name: str, system: BenchSystem, sizes: Sizes) -> tuple[list[Figure], dict[str, str] | None]:
    """One measure's figures; or none and why, when the cluster lacks a nemesis it needs (never a
    silent skip: the reason goes into the results)."""
    try:
        return MEASURES[name](system, sizes), None
    except RigUnavailable as exc:
        say(f"  {name}: NOT MEASURED on {system.rig.cluster_type}: {exc}")
        return [], {"measure": name, "reason": str(exc)}


def cluster_record(rig: Rig | ExternalCluster) -> dict[str, Any]:
    """Which cluster ran the measures: rig, kind or external, and its Kubernetes."""
    with rig.api_client() as api:
        version = client.VersionApi(api).get_code().git_version
    return {"type": rig.cluster_type, "kubernetes": version, "schedulable_nodes": len(rig.nodes),
            "worker_image": rig.worker_image}


def run(rig: Rig | ExternalCluster, postgres: PostgresServer, measures: list[str], sizes: Sizes) -> dict[str, Any]:
    started = datetime.now().astimezone()
    workdir = Path(tempfile.mkdtemp(prefix="retex-bench-"))
    figures: list[Figure] = []
    not_measured: list[dict[str, str]] = []
    system = BenchSystem(rig, postgres, workdir=workdir)
    try:
        for name in measures:
            say(f"measuring {name}")
            taken, missing = measure(name, system, sizes)
            not_measured += [missing] if missing else []
            for figure in taken:
                say(f"  {figure.measure}: retex {figure.retex:.3g} {figure.unit}, {figure.baseline_name} "
                    f"{figure.baseline:.3g}; ratio {figure.ratio:.2f} (target {figure.target}): {verdict(figure.met)}")
                figures.append(figure)
    finally:
        system.close()
    return {"run": {"code": _code_version(), "started": started.isoformat(timespec="seconds"),
                    "finished": datetime.now().astimezone().isoformat(timespec="seconds")},
            "machine": {"cores": os.cpu_count(), "memory_gib": _memory_gib(), "platform": platform.platform()},
            "cluster": cluster_record(rig),
            "settings": {**asdict(sizes), "recovery_lease_seconds": LEASE_SECONDS,
                         "leader_election_seconds": asdict(DEPLOYED_ELECTION),
                         "status_resync_seconds": DEPLOYED_RESYNC_SECONDS,
                         "finalizer_at_create": system.finalizer_binding is not None},
            "figures": [asdict(f) for f in figures], "not_measured": not_measured}


def default_outputs(cluster_type: str) -> tuple[Path, Path]:
    """Where results and charts go by default: one results file per cluster type beside the charts
    (results-rig.json, results-kind.json), another cluster's charts in a folder of their own
    (docs/benchmarks/kind/), so neither overwrites the other."""
    results = CHARTS / f"results-{cluster_type}.json"
    return results, CHARTS if cluster_type == "rig" else CHARTS / cluster_type


def _code_version() -> str | None:
    """The commit the bench ran from, `+changes` when the work tree differed from it (but in what
    the bench itself writes: its results and charts); None outside git."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--", ".",
                              f":!{CHARTS.relative_to(REPO)}"],
                             capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+changes" if changed else "")


def _memory_gib() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def chart_name(measure: str) -> str:
    """A figure's chart's name, from its measure alone: a run of some measures replaces their
    charts and leaves the others' (numbered by position, a new figure shifted every later name
    and left the earlier run's charts beside the new ones)."""
    return re.sub(r"[^a-z0-9]+", "-", measure.lower()).strip("-")[:80]


CHART_WIDTH_INCHES, CHART_DPI = 8.0, 100  # 800 px: a page's width, its text at the page's size
LABEL_CHARACTERS, TITLE_CHARACTERS = 34, 90  # a line of a side's label, of the title: wrapped, never cut
RETEX_COLOUR, BASELINE_COLOUR, TARGET_COLOUR = "#3b6ea5", "#7f7f7f", "#c0392b"


def charts(results: dict[str, Any], directory: Path) -> list[Path]:
    """One chart per figure, named for its measure (`draw_chart`)."""
    pyplot = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for figure in results["figures"]:
        drawn = draw_chart(figure)
        path = directory / f"{chart_name(figure['measure'])}.png"
        drawn.savefig(path, dpi=CHART_DPI)
        pyplot.close(drawn)
        written.append(path)
    return written


def draw_chart(figure: dict[str, Any]) -> Any:
    """A figure's chart: where it holds both sides' samples, their distributions (each side's
    cumulative share of samples, its p50 and p95 marked); else each side's figures that the results
    hold (the figure's own percentile, and its p50 where the detail has it). The target as a line
    where it puts retex at a value; the ratio and the verdict in the title."""
    pyplot = _pyplot()
    drawn, axes = pyplot.subplots(figsize=(CHART_WIDTH_INCHES, 4.0), layout="constrained")
    target = target_at(figure)
    if figure.get("retex_samples") and figure.get("baseline_samples"):
        _draw_distributions(drawn, axes, figure, target)
    else:
        _draw_summaries(axes, figure, target)
    judged = {None: "not judged against", True: "meets", False: "falls short of"}[figure["met"]]
    title = [*textwrap.wrap(figure["measure"], TITLE_CHARACTERS),
             *textwrap.wrap(f"ratio {figure['ratio']:.2f}: {judged} the target, {figure['target']}", TITLE_CHARACTERS)]
    drawn.suptitle("\n".join(title), x=0.01, ha="left", fontsize=10)  # the picture's width, not the axes'
    return drawn


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def _wrapped(text: str, width: int = LABEL_CHARACTERS) -> str:
    return "\n".join(textwrap.wrap(text, width))


def target_at(figure: dict[str, Any]) -> float | None:
    """Where the figure's target puts retex, in its samples' unit: the measure's own `target_at`,
    else read from the target as the results state it (absolute seconds or MB, a ratio to the
    baseline, a difference from it); None when it names no such value."""
    if figure.get("target_at") is not None:
        return float(figure["target_at"])
    target, baseline = figure["target"], figure["baseline"]
    if ratio := re.fullmatch(r"ratio ≤ ([\d.]+)", target):
        return float(ratio[1]) * baseline
    if at_least := re.fullmatch(r"≥ ([\d.]+)× .*", target):
        return float(at_least[1]) * baseline
    if difference := re.search(r"\(the difference\) ≤ ([\d.]+)$", target):
        return baseline + float(difference[1])
    absolute = re.findall(r"([\d.]+) (s|MB)\b", target) if "≤" in target else []
    if absolute and absolute[-1][1] == figure["unit"]:
        return float(absolute[-1][0])
    return None


def _draw_distributions(drawn: Any, axes: Any, figure: dict[str, Any], target: float | None) -> None:
    sides = (("retex", figure["retex_samples"], RETEX_COLOUR),
             (figure["baseline_name"], figure["baseline_samples"], BASELINE_COLOUR))
    for label, samples, colour in sides:
        ordered = sorted(samples)
        shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
        axes.step([ordered[0], *ordered], [0.0, *shares], where="post", color=colour, linewidth=1.8,
                  label=_wrapped(f"{label} ({len(ordered)} samples)"))
        for q in (50, 95):
            value = percentile(ordered, q)
            axes.plot([value], [q / 100], marker="o", color=colour)
            # Left of the point and above it: a cumulative curve leaves that corner empty.
            axes.annotate(f"p{q} {value:.3g}", (value, q / 100), textcoords="offset points", xytext=(-6, 3),
                          ha="right", fontsize=8, color=colour)
    if target is not None:
        axes.axvline(target, color=TARGET_COLOUR, linestyle="--", label=_wrapped(f"target: {figure['target']}"))
    values = [*figure["retex_samples"], *figure["baseline_samples"], *([target] if target else [])]
    if min(values) > 0 and max(values) / min(values) > 20:  # sides an order of magnitude apart
        from matplotlib import ticker

        axes.set_xscale("log")
        axes.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        axes.xaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_ylim(0, 1.08)
    axes.set_ylabel("share of samples ≤ x")
    axes.set_xlabel(_wrapped(figure.get("samples_unit") or figure["unit"], 80))
    axes.grid(alpha=0.3)
    drawn.legend(loc="outside right upper", fontsize=8)


def _summary_marks(figure: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """Each side's figures the results hold without samples: the figure itself (named by its
    percentile when it is one) and the p50 and p95 its detail records."""
    named = re.search(r"\bp(\d+)$", figure["measure"])
    own = f"p{named[1]}" if named else "figure"
    detail = figure.get("detail") or {}
    retex, baseline = {own: figure["retex"]}, {own: figure["baseline"]}
    for key, side, label in (("retex_p50", retex, "p50"), ("p50", retex, "p50"), ("p95", retex, "p95"),
                             ("job_p50", baseline, "p50"), ("watch_p50", baseline, "p50")):
        if isinstance(detail.get(key), int | float):
            side[label] = float(detail[key])
    return retex, baseline


def _draw_summaries(axes: Any, figure: dict[str, Any], target: float | None) -> None:
    retex, baseline = _summary_marks(figure)
    rows = ((1, retex, RETEX_COLOUR), (0, baseline, BASELINE_COLOUR))
    if len(retex) == len(baseline) == 1:
        bars = axes.barh([1, 0], [*retex.values(), *baseline.values()], color=[RETEX_COLOUR, BASELINE_COLOUR],
                         height=0.5)
        axes.bar_label(bars, fmt="%.3g", padding=3, fontsize=8)
    else:
        for row, marks, colour in rows:
            axes.plot([min(marks.values()), max(marks.values())], [row, row], color=colour, linewidth=1.5)
            # Above and below the line in turn, so close values' labels do not overlap.
            for i, (label, value) in enumerate(sorted(marks.items(), key=lambda mark: mark[1])):
                axes.plot([value], [row], marker="o", color=colour)
                axes.annotate(f"{label} {value:.3g}", (value, row), textcoords="offset points",
                              xytext=(-3, 8 if i % 2 == 0 else -16), ha="left", fontsize=8, color=colour)
    if target is not None:
        axes.axvline(target, color=TARGET_COLOUR, linestyle="--")
        axes.annotate(_wrapped(f"target: {figure['target']}", 40), (target, 0.5), textcoords="offset points",
                      xytext=(4, 0), fontsize=8, color=TARGET_COLOUR, va="center")
    axes.set_yticks([1, 0], [_wrapped("retex"), _wrapped(figure["baseline_name"])], fontsize=9)
    axes.set_ylim(-0.6, 1.6)
    right = max([*retex.values(), *baseline.values(), *([target] if target else [])])
    axes.set_xlim(0, right * 1.35)  # room for the labels right of the largest value
    axes.set_xlabel(figure["unit"])
    axes.grid(axis="x", alpha=0.3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench", description=__doc__.split("\n")[0])
    parser.add_argument("measures", nargs="*", metavar="MEASURE", help=f"one of {', '.join(MEASURES)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every measure")
    parser.add_argument("--size", action="append", default=[], metavar="NAME=N",
                        help="override one size (of the full sizes, or of --quick's), e.g. latency_tasks=10")
    parser.add_argument("--out", type=Path, help=f"default {RESULTS.relative_to(REPO)} (kind: results-kind.json beside it)")
    parser.add_argument("--charts", type=Path, help=f"default {CHARTS.relative_to(REPO)} (kind: its kind/)")
    args = parser.parse_args(argv)
    unknown = set(args.measures) - set(MEASURES)
    if unknown:
        parser.error(f"unknown measure(s) {', '.join(sorted(unknown))}: choose from {', '.join(MEASURES)}")
    try:
        sizes = (Sizes.quick() if args.quick else Sizes()).with_overrides(args.size)
    except ValueError as exc:
        parser.error(str(exc))
    if os.environ.get("RETEX_KUBECONFIG") and not os.environ.get("RETEX_POD_HOST"):
        parser.error("RETEX_KUBECONFIG needs RETEX_POD_HOST: where the cluster's pods reach this host (e2e/kind/run.sh)")
    external = from_environment()
    postgres = PostgresServer()
    rig: Rig | ExternalCluster
    if external is None:
        state = Path(tempfile.mkdtemp(prefix="retex-bench-rig-"))
        say(f"starting the local rig and Postgres (state in {state})")
        rig = Rig(state / "rig")
        rig.up(owner_pid=os.getpid())
    else:
        rig = external
        say(f"on the {rig.cluster_type} cluster of {rig.kubeconfig} (its pods reach this host at {rig.pod_host}); "
            "starting Postgres")
    out, chart_dir = default_outputs(rig.cluster_type)
    out, chart_dir = args.out or out, args.charts or chart_dir
    postgres.start()
    try:
        results = run(rig, postgres, in_run_order(args.measures), sizes)
    finally:
        postgres.destroy()
        if isinstance(rig, Rig):  # started here; another cluster is left as it was
            rig.down()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for path in charts(results, chart_dir):
        say(f"chart {path}")
    say(f"results {out}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    raise SystemExit(main())
