"""`retex-worker` processes against the rig's real API server and a real ledger: the Lease protocol
(acquire, contention, renewal, release), graceful drain, zombie fencing, stale pods, failpoints.

The workers run directly on the host with the rig's admin kubeconfig; the Lease is created the
way the operator creates it (retex.kube.objects.build_lease). They reach the ledger through the
operator's ledger endpoint, served here by the test, with the token of a real (never running) pod
of their attempt's Job (e2e.attempt_identity). One test runs the worker as a real pod with the
worker's own ServiceAccount and RBAC. The external system is a counting stub: each
delivery of an exec step appends its idempotency key to a file; a deduping system executes once
per key, so "real executions" are distinct keys, "deliveries" are lines.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes import client
from kubernetes.client import BatchV1Api, CoreV1Api

from e2e.attempt_identity import LocalLedgerEndpoint, pending_attempt_pods, pod_token
from e2e.rig.waits import job_pods, wait_job_finished
from e2e.service import pipe
from e2e.system import prepare_namespace
from retex.api.models import TaskSpec
from retex.kube.leases import LeaseTiming, read_lease, released_by
from retex.kube.objects import WorkerDefaults, build_job, build_lease, lease_name
from retex.kube.rest import Credentials, RestClient
from retex.ledger import Ledger, TaskAdmission, spec_hash
from retex.machine import Backoff, StepState, TaskPhase

NAMESPACE = "worker-lease"
DURATION = 3
PY = sys.executable
WORKER = str(Path(sys.executable).parent / "retex-worker")
EFFECT = [PY, "-c", "import os; open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]
VERIFY = [PY, "-c", "import os, sys\n"
                    "key, path = os.environ['RETEX_IDEMPOTENCY_KEY'], os.environ['COUNTS']\n"
                    "ran = os.path.exists(path) and key in open(path).read().split()\n"
                    "print(key) if ran else sys.exit(int(os.environ['RETEX_NOT_FOUND_EXIT_CODE']))"]


def slow_effect(seconds: float) -> list[str]:
    return [PY, "-c", f"import os, time; time.sleep({seconds}); "
                      "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]


@pytest.fixture(scope="module")
def api(rig):
    prepare_namespace(rig.kubectl, NAMESPACE)  # the retex-worker ServiceAccount and Role
    with rig.api_client() as api_client:
        yield api_client
    rig.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


@pytest.fixture(scope="module")
def lease_client(rig):
    """The worker's own client (retex.kube.rest), as the admin user: the test reads Leases as the workers do."""
    client = RestClient(Credentials.from_kubeconfig(str(rig.kubeconfig)))
    yield client
    client.close()


def without_owner(body: dict) -> dict:
    """These tests admit tasks to the ledger without a Task object; once any test has installed the
    CRD, the garbage collector deletes objects owned by a Task that does not exist."""
    body["metadata"].pop("ownerReferences", None)
    return body


class Task:
    """A task admitted to the ledger with its Lease created, as the operator would leave them."""

    def __init__(self, ledger: Ledger, api, lease_client: RestClient, tmp_path: Path, steps: list[dict],
                 counts: Path | None = None, duration: int = DURATION):
        self.ledger, self.api, self.tmp_path, self.duration = ledger, api, tmp_path, duration
        self.lease_client = lease_client
        self.counts = counts or tmp_path / "deliveries"
        self.uid = str(uuid.uuid4())
        self.name = f"order-{self.uid[:8]}"
        env = [{"name": "COUNTS", "value": str(self.counts)}]
        # Every exec (step and verify) gets the stub's file.
        with_env = lambda action: {**action, "exec": {**action["exec"], "env": env}}  # noqa: E731
        steps = [with_env({**s, **({"verify": with_env(s["verify"])} if "verify" in s else {})}) for s in steps]
        # A verify of a step that may be in flight waits until its begin + timeoutSeconds + 5 s:
        # keep that short where a test verifies.
        steps = [{"timeoutSeconds": 2, **s} if "verify" in s else s for s in steps]
        spec = {"steps": steps,
                "lease": {"durationSeconds": 5}}
        # As admission stores it (the Job carries this spec's hash; the worker runs no other).
        spec = TaskSpec.model_validate(spec).as_admitted()
        ledger.admit(TaskAdmission(uid=self.uid, namespace=NAMESPACE, name=self.name, spec=spec,
                                   step_names=[s["name"] for s in steps],
                                   backoff=Backoff(initial_seconds=0.01, max_seconds=0.05)))
        self.lease_name = lease_name(self.name, self.uid)
        self._identities: dict[int, list[tuple[str, Path]]] = {}
        client.CoordinationV1Api(api).create_namespaced_lease(
            NAMESPACE, without_owner(build_lease(task_name=self.name, task_uid=self.uid, namespace=NAMESPACE,
                                                 duration_seconds=duration)))

    def lease(self) -> dict:
        return read_lease(self.lease_client, NAMESPACE, self.lease_name, timeout=5)

    def holder(self) -> str | None:
        return self.lease()["spec"].get("holderIdentity")

    def record(self):
        return self.ledger.get(self.uid)

    def deliveries(self) -> list[str]:
        return self.counts.read_text().split() if self.counts.exists() else []

    def key(self, idx: int) -> str:
        return self.record().steps[idx].idempotency_key

    def job(self, epoch: int, endpoint: LocalLedgerEndpoint | None = None) -> dict:
        """Attempt `epoch`'s Job exactly as the operator builds it (without the Task owner)."""
        return without_owner(build_job(
            task_name=self.name, task_uid=self.uid, namespace=NAMESPACE, epoch=epoch,
            spec=TaskSpec.model_validate(self.record().spec),
            defaults=WorkerDefaults(image="retex-worker:local", service_account="retex-worker",
                                    ledger_url=endpoint.url if endpoint else "",
                                    ledger_ca=endpoint.ca_pem if endpoint else None, termination_grace_seconds=10)))

    def identity(self, epoch: int, slot: int) -> tuple[str, Path]:
        """(pod name, token file) of pod `slot` of attempt `epoch`'s Job, which has two pods: the
        ledger knows a worker by this pod, whatever name the worker process gives itself."""
        if epoch not in self._identities:
            pods = pending_attempt_pods(self.api, self.job(epoch), 2)
            self._identities[epoch] = [
                (pod.metadata.name, pod_token(self.api, pod, self.tmp_path / f"token-{pod.metadata.name}"))
                for pod in pods]
        return self._identities[epoch][slot]

    def worker(self, pod: str, epoch: int, endpoint: LocalLedgerEndpoint, kubeconfig: Path, slot: int = 0,
               **env: str) -> Worker:
        return Worker(self, pod, epoch, endpoint, kubeconfig, slot, env)


class Worker:
    """One `retex-worker` process, in its own process group (so it can be paused like a pod)."""

    def __init__(self, task: Task, pod: str, epoch: int, endpoint: LocalLedgerEndpoint, kubeconfig: Path,
                 slot: int, extra_env: dict[str, str]):
        self.pod = pod
        self.identity, token = task.identity(epoch, slot)
        self.log_path = task.tmp_path / f"{pod}.log"
        environment = {
            **os.environ, "KUBECONFIG": str(kubeconfig), "RETEX_TASK_UID": task.uid,
            "RETEX_TASK_NAMESPACE": NAMESPACE, "RETEX_TASK_NAME": task.name, "RETEX_EPOCH": str(epoch),
            "RETEX_LEASE_NAME": task.lease_name, "RETEX_LEASE_DURATION_SECONDS": str(task.duration),
            "RETEX_LEDGER_URL": endpoint.url, "RETEX_LEDGER_CA": endpoint.ca_pem, "RETEX_LEDGER_TOKEN_FILE": str(token),
            "RETEX_SPEC_HASH": spec_hash(task.record().spec),
            "POD_NAME": pod, "NODE_NAME": "host", **extra_env,
        }
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([WORKER], env=environment, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"worker {self.pod} still running after {timeout}s:\n{self.log()}") from None

    def signal_group(self, signum: int) -> None:
        os.killpg(self.proc.pid, signum)

    def log(self) -> str:
        return self.log_path.read_text()


def wait_until(what: str, check, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def renewal_stopped(task) -> str | None:
    """The renewTime, once it has not moved for two retry periods (a renewal already in flight
    when the pause landed may still arrive)."""
    seen = task.lease()["spec"]["renewTime"]
    time.sleep(2 * LeaseTiming.of(DURATION).retry_period)
    return seen if task.lease()["spec"]["renewTime"] == seen else None


def lease_expired(lease: dict) -> bool:
    spec = lease["spec"]
    renewed = datetime.fromisoformat(spec["renewTime"].replace("Z", "+00:00"))
    return datetime.now(UTC) > renewed + timedelta(seconds=spec["leaseDurationSeconds"])


@pytest.fixture
def new_task(ledger, api, lease_client, tmp_path):
    return lambda steps, **kwargs: Task(ledger, api, lease_client, tmp_path, steps, **kwargs)


@pytest.fixture
def endpoint(ledger, api):
    served = LocalLedgerEndpoint(ledger, api)
    yield served
    served.close()


def test_worker_takes_the_lease_renews_it_runs_the_task_and_releases_it(new_task, endpoint, rig):
    task = new_task([{"name": "charge", "exec": {"command": slow_effect(2.5)}}])
    # Every import of the whole run on its stderr (the log): the kubernetes package is not one of them.
    worker = task.worker("pod-a", 1, endpoint, rig.kubeconfig, PYTHONPROFILEIMPORTTIME="1")
    wait_until("the lease to be taken", lambda: task.holder() == "pod-a:1")
    first = task.lease()["spec"]
    assert first["leaseDurationSeconds"] == DURATION and first["leaseTransitions"] == 1
    # Renewed while the step runs (every retry period): the renewTime moves, the holder stays.
    wait_until("a renewal", lambda: task.lease()["spec"].get("renewTime") != first["renewTime"])
    assert task.holder() == "pod-a:1"
    assert worker.wait() == 0, worker.log()
    lease = task.lease()
    assert task.record().phase == TaskPhase.SUCCEEDED
    assert lease["spec"].get("holderIdentity") is None and released_by(lease).identity == "pod-a:1"
    assert lease["spec"]["acquireTime"] == first["acquireTime"]  # history kept, lease not deleted
    assert task.deliveries() == [task.key(0)]
    assert task.ledger.attempts(task.uid)[0].pod == worker.identity  # the pod its token is bound to
    imported = [line.rsplit("|", 1)[1].strip() for line in worker.log().splitlines() if line.startswith("import time:")]
    assert "retex.kube.rest" in imported and "retex.worker.steps.exec_step" in imported
    assert not [name for name in imported if name.split(".")[0] == "kubernetes"]


def test_two_pods_for_one_attempt_exactly_one_runs_the_other_exits_3_without_a_trace(new_task, endpoint, rig):
    task = new_task([{"name": "charge", "exec": {"command": slow_effect(2)}}])
    a = task.worker("pod-a", 1, endpoint, rig.kubeconfig, slot=0)
    b = task.worker("pod-b", 1, endpoint, rig.kubeconfig, slot=1)
    codes = {a: a.wait(), b: b.wait()}
    assert sorted(codes.values()) == [0, 3], (a.log(), b.log())
    winner = next(w for w, code in codes.items() if code == 0)
    loser = next(w for w, code in codes.items() if code == 3)
    assert task.record().phase == TaskPhase.SUCCEEDED
    assert task.deliveries() == [task.key(0)]  # one execution
    assert task.ledger.attempts(task.uid)[0].pod == winner.identity
    assert not [h for h in task.ledger.history(task.uid) if h.actor == f"worker:{loser.identity}"]
    assert [h for h in task.ledger.history(task.uid) if h.actor == f"worker:{winner.identity}"]
    assert released_by(task.lease()).pod == winner.pod


def test_sigterm_drains_the_current_step_commits_it_releases_the_lease_and_exits_75(new_task, endpoint, rig):
    task = new_task([{"name": "charge", "exec": {"command": slow_effect(1.5)}},
                     {"name": "ship", "exec": {"command": EFFECT}}])
    worker = task.worker("pod-a", 1, endpoint, rig.kubeconfig)
    wait_until("step 1 to start", lambda: task.record().steps[0].state == StepState.STARTED)
    worker.proc.send_signal(signal.SIGTERM)  # to the worker only, as the kubelet signals PID 1
    assert worker.wait() == 75, worker.log()
    record, lease = task.record(), task.lease()
    assert [s.state for s in record.steps] == [StepState.DONE, StepState.PENDING]
    assert record.phase == TaskPhase.RUNNING and record.failures == 0  # nothing counted as a failure
    assert lease["spec"].get("holderIdentity") is None and released_by(lease).identity == "pod-a:1"
    assert task.deliveries() == [task.key(0)]


def test_paused_zombie_is_fenced_after_a_new_attempt_every_write_rejected(new_task, endpoint, rig, tmp_path):
    running = tmp_path / "running"
    marked = [PY, "-c", f"import os, time; open({str(running)!r}, 'w').close(); time.sleep(1); "
                        "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]
    task = new_task([{"name": "charge", "exec": {"command": marked}, "verify": {"exec": {"command": VERIFY}}},
                     {"name": "ship", "exec": {"command": EFFECT}}])
    zombie = task.worker("pod-old", 1, endpoint, rig.kubeconfig)
    # Paused inside the step (its process has started), not between the begin and the run.
    wait_until("step 1 to run", running.exists)
    zombie.signal_group(signal.SIGSTOP)  # the worker and its step: alive, doing nothing
    # The operator sees no renewal for the lease duration and starts attempt 2. The pause fired:
    # the renewal seen once the pause took hold is still the last one when the lease expires.
    paused_renewal = wait_until("the lease to stop renewing", lambda: renewal_stopped(task))
    wait_until("the lease to expire", lambda: lease_expired(task.lease()), timeout=DURATION * 3)
    assert task.lease()["spec"]["renewTime"] == paused_renewal
    epoch = task.ledger.replace_attempt(task.uid, 1, cause="lease-expired").epoch
    successor = task.worker("pod-new", epoch, endpoint, rig.kubeconfig)
    assert successor.wait() == 0, successor.log()
    assert task.record().phase == TaskPhase.SUCCEEDED
    lease_before = task.lease()
    version_before = task.record().version

    zombie.signal_group(signal.SIGCONT)
    assert zombie.wait() == 3, zombie.log()
    record = task.record()
    assert record.version == version_before  # not one ledger write landed
    assert task.lease()["metadata"]["resourceVersion"] == lease_before["metadata"]["resourceVersion"]
    # The zombie's step delivered again with the same key; the deduping system executes it once.
    assert set(task.deliveries()) == {task.key(0), task.key(1)}
    assert "fenced" in zombie.log()


def test_a_stale_pod_after_the_task_is_terminal_exits_3_touching_nothing(new_task, endpoint, rig):
    task = new_task([{"name": "charge", "exec": {"command": EFFECT}}])
    assert task.worker("pod-a", 1, endpoint, rig.kubeconfig).wait() == 0
    lease, version = task.lease(), task.record().version
    stale = task.worker("pod-a-again", 1, endpoint, rig.kubeconfig)
    assert stale.wait() == 3, stale.log()
    assert task.lease()["metadata"]["resourceVersion"] == lease["metadata"]["resourceVersion"]
    assert task.record().version == version and task.deliveries() == [task.key(0)]


def test_a_pod_of_an_older_epoch_refuses_a_lease_held_by_a_newer_one(new_task, endpoint, rig):
    task = new_task([{"name": "charge", "exec": {"command": slow_effect(2)}}])
    task.ledger.replace_attempt(task.uid, 1, cause="lease-expired")
    current = task.worker("pod-new", 2, endpoint, rig.kubeconfig)
    wait_until("the lease to be taken", lambda: task.holder() == "pod-new:2")
    old = task.worker("pod-old", 1, endpoint, rig.kubeconfig)
    assert old.wait() == 3
    assert current.wait() == 0
    assert task.deliveries() == [task.key(0)]


def test_a_worker_whose_job_was_built_from_another_spec_runs_nothing_and_touches_no_lease(new_task, endpoint, rig):
    task = new_task([{"name": "charge", "exec": {"command": EFFECT}}])
    lease, version = task.lease(), task.record().version
    worker = task.worker("pod-a", 1, endpoint, rig.kubeconfig, RETEX_SPEC_HASH="0" * 64)
    assert worker.wait() == 2, worker.log()
    assert "spec refused: not the Task's" in worker.log()
    assert task.lease()["metadata"]["resourceVersion"] == lease["metadata"]["resourceVersion"]
    assert task.record().version == version and task.deliveries() == []


def test_a_missing_lease_means_disrupted(new_task, endpoint, rig, api):
    task = new_task([{"name": "charge", "exec": {"command": EFFECT}}])
    client.CoordinationV1Api(api).delete_namespaced_lease(task.lease_name, NAMESPACE)
    worker = task.worker("pod-a", 1, endpoint, rig.kubeconfig)
    assert worker.wait() == 75, worker.log()
    assert task.deliveries() == [] and task.record().steps[0].state == StepState.PENDING


def test_killed_after_the_effect_the_next_attempt_verifies_and_commits_without_rerunning(new_task, endpoint, rig):
    task = new_task([{"name": "charge", "exec": {"command": EFFECT}, "verify": {"exec": {"command": VERIFY}}}])
    crashed = task.worker("pod-a", 1, endpoint, rig.kubeconfig, RETEX_FAILPOINT="after-effect:charge")
    assert crashed.wait() == -signal.SIGKILL
    assert task.holder() == "pod-a:1"  # a crash does not release: the lease expires
    epoch = task.ledger.replace_attempt(task.uid, 1, cause="lease-expired").epoch
    assert task.worker("pod-b", epoch, endpoint, rig.kubeconfig).wait() == 0
    record = task.record()
    assert record.phase == TaskPhase.SUCCEEDED and record.steps[0].result["verified"] is True
    assert task.deliveries() == [task.key(0)]  # one real execution, one delivery


# (in-commit is no worker point: the commit transaction runs in the operator's ledger endpoint.)
@pytest.mark.slow
@pytest.mark.parametrize("point", ["after-lease", "before-step", "after-begin", "after-effect",
                                   "after-commit", "before-complete"])
def test_a_worker_killed_at_any_failpoint_is_recovered_by_the_next_attempt_with_one_execution_per_step(
        new_task, endpoint, rig, point):
    task = new_task([{"name": "charge", "exec": {"command": EFFECT}, "verify": {"exec": {"command": VERIFY}}},
                     {"name": "ship", "exec": {"command": EFFECT}, "verify": {"exec": {"command": VERIFY}}}])
    # Step-level points are armed for the second step, so the first is committed before the crash.
    armed = point if point in ("after-lease", "before-complete") else f"{point}:ship"
    crashed = task.worker("pod-a", 1, endpoint, rig.kubeconfig, RETEX_FAILPOINT=armed)
    assert crashed.wait() == -signal.SIGKILL, crashed.log()
    epoch = task.ledger.replace_attempt(task.uid, 1, cause="lease-expired").epoch
    successor = task.worker("pod-b", epoch, endpoint, rig.kubeconfig)
    assert successor.wait() == 0, successor.log()
    assert task.record().phase == TaskPhase.SUCCEEDED
    assert sorted(task.deliveries()) == sorted([task.key(0), task.key(1)])  # each step really ran once


@pytest.mark.slow
@pytest.mark.parametrize("point, ship", [
    # begun, never run: attempt 3's verify finds nothing and runs it once
    ("after-begin", {"exec": {"command": EFFECT}, "verify": {"exec": {"command": VERIFY}}}),
    # run, never committed, idempotent: each attempt re-sends it with the same key
    ("after-effect", {"exec": {"command": EFFECT}, "idempotent": True}),
])
def test_a_second_attempt_killed_at_the_same_point_is_recovered_by_a_third_with_one_execution_per_step(
        new_task, endpoint, rig, point, ship):
    task = new_task([{"name": "charge", "exec": {"command": EFFECT}, "verify": {"exec": {"command": VERIFY}}},
                     {"name": "ship", **ship}])
    epoch = 1
    for pod in ("pod-a", "pod-b"):  # attempts 1 and 2 die at the same point of `ship`
        crashed = task.worker(pod, epoch, endpoint, rig.kubeconfig, RETEX_FAILPOINT=f"{point}:ship")
        assert crashed.wait() == -signal.SIGKILL, crashed.log()
        assert f"retex failpoint {point}:ship fired" in crashed.log()
        epoch = task.ledger.replace_attempt(task.uid, epoch, cause="lease-expired").epoch
    begun = sorted({h.epoch for h in task.ledger.history(task.uid) if h.event == "step-begin" and h.step_idx == 1})
    assert (epoch, begun) == (3, [1, 2]), "ship was begun by attempts 1 and 2, both killed"
    third = task.worker("pod-c", epoch, endpoint, rig.kubeconfig)
    assert third.wait() == 0, third.log()
    assert task.record().phase == TaskPhase.SUCCEEDED
    assert set(task.deliveries()) == {task.key(0), task.key(1)}  # each step executed once (one key each)
    assert task.deliveries().count(task.key(0)) == 1  # charge, committed by attempt 1, never sent again
    assert task.deliveries().count(task.key(1)) == (3 if point == "after-effect" else 1)


def shared_stub_file() -> Path:
    """A delivery file a pod (running as a non-root user) can write."""
    shared = Path(tempfile.mkdtemp(prefix="retex-stub-"))
    shared.chmod(0o777)
    return shared / "deliveries"


def start_job(task: Task, endpoint: LocalLedgerEndpoint, api) -> str:
    """The attempt-1 Job exactly as the operator builds it, in a namespace prepared as it would be."""
    job = task.job(1, endpoint)
    BatchV1Api(api).create_namespaced_job(NAMESPACE, job)
    return job["metadata"]["name"]


# These run the worker in a Job pod that reaches this test's ledger endpoint on 127.0.0.1 and
# appends to the counting stub's file on this host: the rig's pods are host processes and can,
# kind's cannot. On kind the crash matrix covers both: every row's worker runs in a Job pod with
# its own ServiceAccount, and R13 evicts one.
job_pod_on_this_host = pytest.mark.skipif(
    bool(os.environ.get("RETEX_KUBECONFIG")),
    reason="a Job pod reaching this host's loopback and files: the rig's; kind runs these in the crash matrix (R13)")


@job_pod_on_this_host
def test_the_worker_runs_as_a_job_pod_with_only_its_own_rbac(new_task, endpoint, rig, api):
    task = new_task([{"name": "charge", "exec": {"command": EFFECT}}], counts=shared_stub_file())
    job_name = start_job(task, endpoint, api)
    assert wait_job_finished(BatchV1Api(api), NAMESPACE, job_name, timeout=60) == "Complete"
    [pod] = job_pods(CoreV1Api(api), NAMESPACE, job_name)
    assert task.record().phase == TaskPhase.SUCCEEDED
    assert released_by(task.lease()).identity == f"{pod.metadata.name}:1"
    assert task.ledger.attempts(task.uid)[0].node == pod.spec.node_name
    assert task.deliveries() == [task.key(0)]


@job_pod_on_this_host
def test_an_evicted_worker_pod_commits_its_running_step_and_releases_the_lease(new_task, endpoint, rig, api):
    task = new_task([{"name": "charge", "exec": {"command": slow_effect(2)}},
                     {"name": "ship", "exec": {"command": EFFECT}}], counts=shared_stub_file())
    job_name = start_job(task, endpoint, api)
    wait_until("step 1 to start", lambda: task.record().steps[0].state == StepState.STARTED, timeout=60)
    [pod] = job_pods(CoreV1Api(api), NAMESPACE, job_name)
    CoreV1Api(api).create_namespaced_pod_eviction(pod.metadata.name, NAMESPACE, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=pod.metadata.name, namespace=NAMESPACE)))
    wait_until("the lease to be released", lambda: released_by(task.lease()) is not None, timeout=20)
    record = task.record()
    assert released_by(task.lease()).identity == f"{pod.metadata.name}:1"
    assert [s.state for s in record.steps] == [StepState.DONE, StepState.PENDING]
    assert record.failures == 0 and task.deliveries() == [task.key(0)]


def test_a_worker_that_loses_its_lease_kills_the_running_step_records_nothing_and_starts_no_other(
        new_task, endpoint, rig, api):
    # Its successor may start as soon as the operator judges the lease gone: the step must not
    # finish its effect behind the successor's back.
    task = new_task([{"name": "charge", "exec": {"command": slow_effect(DURATION + 1)}},
                     {"name": "ship", "exec": {"command": EFFECT}}])
    worker = task.worker("pod-a", 1, endpoint, rig.kubeconfig)
    wait_until("step 1 to start", lambda: task.record().steps[0].state == StepState.STARTED)
    client.CoordinationV1Api(api).delete_namespaced_lease(task.lease_name, NAMESPACE)
    assert worker.wait() == 75, worker.log()
    assert [s.state for s in task.record().steps] == [StepState.STARTED, StepState.PENDING]
    assert task.deliveries() == []
    assert "lease lost" in worker.log()


def wait_for_file(go: Path) -> list[str]:
    """A step that delivers once the test creates `go`."""
    return [PY, "-c", f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
                      "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]


class CuttableProxy:
    """A TCP forwarder to the API server that a test can cut: while cut, every connection is reset
    and new ones are closed at once. An API outage for one worker, exactly as long as asked."""

    def __init__(self, target: str):
        url = urlsplit(target)
        self._target = (url.hostname, url.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                downstream.close()
                continue
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._open += [downstream, upstream]
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=pipe, args=(source, sink), daemon=True).start()

    def cut_for(self, seconds: float) -> None:
        self._cut.set()
        with self._lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._open.clear()
        time.sleep(seconds)
        self._cut.clear()

    def kubeconfig(self, original: Path, path: Path) -> Path:
        config = yaml.safe_load(original.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        path.write_text(yaml.safe_dump(config))
        return path

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def proxy(rig, tmp_path):
    server = yaml.safe_load(Path(rig.kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
    forwarder = CuttableProxy(server)
    yield forwarder
    forwarder.close()


def test_renewal_rides_out_an_api_outage_shorter_than_the_lease_duration(new_task, endpoint, rig, proxy, tmp_path):
    go = tmp_path / "go"
    task = new_task([{"name": "charge", "exec": {"command": wait_for_file(go)}},
                     {"name": "ship", "exec": {"command": EFFECT}}], duration=6)
    worker = task.worker("pod-a", 1, endpoint, proxy.kubeconfig(Path(rig.kubeconfig), tmp_path / "kubeconfig"))
    wait_until("step 1 to start", lambda: task.record().steps[0].state == StepState.STARTED)
    proxy.cut_for(2)  # renewals every 0.8 s: some fail; 2 s + 0.8 s < the 4 s renew deadline
    cut_over = task.lease()["spec"]["renewTime"]
    wait_until("a renewal after the outage", lambda: task.lease()["spec"]["renewTime"] != cut_over)
    go.touch()
    assert worker.wait() == 0, worker.log()
    assert "lease renewal failed" in worker.log()
    assert task.record().phase == TaskPhase.SUCCEEDED
    assert task.deliveries() == [task.key(0), task.key(1)]


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_worker_whose_renewals_fail_kills_its_running_step_before_the_lease_duration_passes(
        new_task, endpoint, rig, proxy, tmp_path):
    # The operator may replace the attempt once it has seen no renewal for the duration; by then
    # the old step must be dead: the worker gives up R after *sending* its last successful
    # renewal and kills the step within K (R + K < D). The Lease's renewTime is the worker's wall
    # clock at that send (same host as this test); a renewal the server wrote but whose answer
    # the cut lost only makes it later, so the bound measured from it holds all the more.
    timing = LeaseTiming.of(DURATION)
    pid_file = tmp_path / "step-pid"
    hang = [PY, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600); "
                      "open(os.environ['COUNTS'], 'a').write(os.environ['RETEX_IDEMPOTENCY_KEY'] + '\\n')"]
    task = new_task([{"name": "charge", "exec": {"command": hang}}, {"name": "ship", "exec": {"command": EFFECT}}])
    worker = task.worker("pod-a", 1, endpoint, proxy.kubeconfig(Path(rig.kubeconfig), tmp_path / "kubeconfig"))
    pid = int(wait_until("the step to start", lambda: pid_file.exists() and pid_file.read_text()))
    threading.Thread(target=proxy.cut_for, args=(DURATION + 5,), daemon=True).start()
    wait_until("the step to be killed", lambda: process_gone(pid), timeout=3 * DURATION)
    killed = datetime.now(UTC)
    last_renewal = datetime.strptime(task.lease()["spec"]["renewTime"], "%Y-%m-%dT%H:%M:%S.%f%z")
    since_renewal = (killed - last_renewal).total_seconds()
    assert since_renewal < timing.renew_deadline + timing.kill, \
        f"killed {since_renewal:.2f}s after the last renewal was sent; R + K = {timing.renew_deadline + timing.kill}s"
    assert worker.wait() == 75, worker.log()
    assert "renew deadline passed" in worker.log()
    assert [s.state for s in task.record().steps] == [StepState.STARTED, StepState.PENDING]  # nothing recorded
    assert task.deliveries() == []


def test_the_attempt_survives_a_real_api_server_restart(new_task, endpoint, rig, tmp_path):
    go = tmp_path / "go"
    # The renew deadline (two thirds of the duration) must outlast the restart.
    task = new_task([{"name": "charge", "exec": {"command": wait_for_file(go)}},
                     {"name": "ship", "exec": {"command": EFFECT}}], duration=30)
    worker = task.worker("pod-a", 1, endpoint, rig.kubeconfig)
    wait_until("step 1 to start", lambda: task.record().steps[0].state == StepState.STARTED)
    rig.restart_apiserver(hard=True)
    go.touch()
    assert worker.wait(60) == 0, worker.log()
    assert task.record().phase == TaskPhase.SUCCEEDED
    assert released_by(task.lease()).identity == "pod-a:1"
    assert task.deliveries() == [task.key(0), task.key(1)]
