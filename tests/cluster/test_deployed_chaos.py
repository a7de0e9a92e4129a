"""On kind: the nemeses hit retex as a user deploys it (manifests/overlays/dev: the operator's
Deployment and the dev Postgres StatefulSet, in retex-system), not the host processes the other
scenarios start. A worker pod evicted through the Eviction API (SIGTERM: the drain), the
operator's pod and Postgres's pod deleted with no grace (their controllers start new ones; the
ledger is on Postgres's volume), and a worker's node cut off the network for longer than the lease
(`KindCluster.partition_node`: everything through its link dropped while its kubelet and pods keep
running: its worker can neither renew its Lease nor reach anything off the node, the operator
starts the next attempt, and the cut-off attempt must be fenced when it is heard again).

Every task ends as in test_chaos: Succeeded with each effect executed once, or NeedsAttention at
`notify` (neither idempotent nor verifiable) with it executed at most once; the notifier counts
every delivery, so an effect sent twice shows even under one key.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from e2e.rig.external import KindCluster
from e2e.system import discard_namespace, task_manifest, wait_for
from tests.cluster.test_chaos import chaos_steps
from tests.cluster.test_crash_matrix import LEASE, effects_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "retex-system"
OPERATOR = "deployment/retex-operator"
TASKS = 6  # at least: one more whenever a nemesis would find no worker running
SETTLE_SECONDS = 300
PARTITION_SECONDS = 20  # four 5 s leases


def onboard_reaching_stubs(rig, namespace: str, stubs) -> None:
    """`namespace` onboarded as a user onboards one (manifests/tenant), its workers also allowed to
    reach the test's stubs on this host."""
    rig.create_namespace(namespace)
    rig.kubectl("apply", "-n", namespace, "-k", str(REPO / "manifests" / "tenant"))
    ports = sorted({urlparse(stub.url).port for stub in stubs})
    rig.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "test-stubs-egress"},
        "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}, "policyTypes": ["Egress"],
                 "egress": [{"to": [{"ipBlock": {"cidr": f"{rig.pod_host}/32"}}],
                             "ports": [{"protocol": "TCP", "port": port} for port in ports]}]}}))


@pytest.fixture
def deployed(rig, stubs):
    """A tenant namespace onboarded as a user onboards one (manifests/tenant), whose workers may
    also reach the stubs, and the deployed operator running (make e2e-kind scales it to 0 for the
    scenarios that start their own)."""
    if not isinstance(rig, KindCluster):
        pytest.skip("the deployed operator and nemeses as pods need kind (make e2e-kind); the rig runs test_chaos")
    namespace = f"deployed-{random.randrange(1 << 24):06x}"
    onboard_reaching_stubs(rig, namespace, stubs)
    rig.kubectl("scale", "-n", SYSTEM, OPERATOR, "--replicas=1")
    rig.kubectl("rollout", "status", "-n", SYSTEM, OPERATOR, "--timeout=180s")
    try:
        yield namespace
    finally:
        rig.kubectl("delete", "tasks", "--all", "-n", namespace, "--timeout=120s", check=False)  # the operator ends them
        discard_namespace(rig.kubectl, namespace)
        rig.kubectl("scale", "-n", SYSTEM, OPERATOR, "--replicas=0")
        rig.kubectl("wait", "-n", SYSTEM, "--for=delete", "pod", "-l", "app.kubernetes.io/component=operator",
                    "--timeout=120s", check=False)


def test_a_deployed_retex_finishes_every_task_once_through_pod_evictions_kills_and_a_partition(rig, stubs, deployed):
    payments, notifier = stubs
    namespace = deployed
    seed = int(os.environ.get("RETEX_CHAOS_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    print(f"deployed chaos seed={seed} namespace={namespace} (replay: RETEX_CHAOS_SEED={seed})", flush=True)

    def kubectl(*args, **kwargs):
        return rig.kubectl("-n", namespace, *args, **kwargs)

    def worker_pods(running: bool = True) -> list[dict]:
        pods = json.loads(kubectl("get", "pods", "-l", "app.kubernetes.io/component=worker", "-o", "json").stdout)["items"]
        return [p for p in pods if not running or (p.get("status") or {}).get("phase") == "Running"]

    def submit() -> None:
        name = f"chaos-{len(submitted)}"
        kubectl("apply", "-f", "-", input=task_manifest(name, chaos_steps(payments, notifier), lease=LEASE))
        submitted[name] = json.loads(kubectl("get", "task", name, "-o", "json").stdout)["metadata"]["uid"]

    def a_running_worker() -> dict:
        """A worker pod Running now, for the nemesis to meet: one more task when none runs within
        20 s (every task may have ended)."""
        deadline = time.monotonic() + 20
        while not (found := worker_pods()) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not found:
            submit()
            found = wait_for(lambda: worker_pods(), timeout=90, what="a worker running", interval=0.5)
        return rng.choice(found)

    def evict_worker():
        from kubernetes import client

        name = a_running_worker()["metadata"]["name"]
        with rig.api_client() as api:
            client.CoreV1Api(api).create_namespaced_pod_eviction(name, namespace, client.V1Eviction(
                metadata=client.V1ObjectMeta(name=name, namespace=namespace)))
        gone = kubectl("get", "pod", name, "-o", "jsonpath={.metadata.deletionTimestamp}", check=False)
        assert gone.returncode != 0 or gone.stdout, f"evicted {name}, yet it is not being deleted"
        return name

    def system_pod_uids(selector: str) -> set[str]:
        pods = json.loads(rig.kubectl("get", "pods", "-n", SYSTEM, "-l", selector, "-o", "json").stdout)["items"]
        return {p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}

    def kill_pod_of(selector: str) -> str:
        """Deleted with no grace (the kubelet SIGKILLs it); proven by a new pod in its place."""
        before = system_pod_uids(selector)
        rig.kubectl("delete", "pod", "-n", SYSTEM, "-l", selector, "--grace-period=0", "--force")
        wait_for(lambda: system_pod_uids(selector) - before, timeout=120, what=f"a new pod for {selector}")
        return f"{selector}: {sorted(before)} replaced"

    def kill_operator():
        return kill_pod_of("app.kubernetes.io/component=operator")

    def kill_postgres():
        return kill_pod_of("app.kubernetes.io/component=postgres")

    def partition_worker_node():
        """Proven from inside the node: its connection to the API server opens before the cut,
        times out during it, and opens again after the heal."""
        node = a_running_worker()["spec"]["nodeName"]
        wait_for(lambda: rig.reaches_api_server(node), timeout=30, what=f"node {node} reaching the API server")
        try:
            rig.partition_node(node)
            cut = time.monotonic()
            assert not rig.reaches_api_server(node), f"node {node} still reaches the API server: not cut off"
            time.sleep(max(0.0, PARTITION_SECONDS - (time.monotonic() - cut)))
        finally:
            rig.heal_node(node)
        wait_for(lambda: rig.reaches_api_server(node), timeout=30, what=f"node {node} reaching the API server again")
        return node

    nemeses = [evict_worker, kill_operator, kill_postgres, partition_worker_node]
    submitted: dict[str, str] = {}
    schedule = []
    started = time.monotonic()
    for nemesis in nemeses * 2:
        if len(submitted) < TASKS:  # work in flight for the nemesis to meet
            submit()
        time.sleep(rng.uniform(1.0, 4.0))
        detail = nemesis()
        schedule.append((round(time.monotonic() - started, 1), nemesis.__name__, detail))
        print(f"  t={schedule[-1][0]}s {nemesis.__name__} {detail or ''}", flush=True)
    print(f"deployed chaos schedule (seed {seed}): {schedule}")
    assert all(detail for _, _, detail in schedule), f"a nemesis met nothing: {schedule} (seed {seed})"

    def phase(name: str) -> str | None:
        shown = json.loads(kubectl("get", "task", name, "-o", "json").stdout)
        return (shown.get("status") or {}).get("phase")

    for name in submitted:
        wait_for(lambda n=name: phase(n) in ("Succeeded", "Failed", "NeedsAttention"), timeout=SETTLE_SECONDS,
                 what=f"{name} terminal (seed {seed})")
    names = [s["name"] for s in chaos_steps(payments, notifier)]
    for name, uid in submitted.items():
        shown = json.loads(kubectl("get", "task", name, "-o", "json").stdout)["status"]
        states = {s["name"]: s["state"] for s in shown["steps"]}
        executions = {effect: c["executions"] for effect, c in effects_of(payments, notifier, uid).items()}
        assert all(n <= 1 for n in executions.values()), f"{name}: an effect executed twice: {executions} (seed {seed})"
        if shown["phase"] == "NeedsAttention":
            flagged = [step for step, state in states.items() if state == "needs-attention"]
            assert flagged == ["notify"], f"{name}: flagged {flagged}: {shown} (seed {seed})"
            continue
        assert shown["phase"] == "Succeeded", f"{name}: {shown} (seed {seed})"
        assert states == dict.fromkeys(names, "done"), f"{name}: {states} (seed {seed})"
        assert executions == {"charge": 1, "ship": 1, "receipt": 1, "notify": 1, "invoice": 1}, \
            f"{name}: {executions} (seed {seed})"
