"""The crash-point matrix (docs/crash-matrix.md): every row on the rig
with the real operator, real worker pods, real Postgres and a counting stub of the outside world.

Each row first proves its fault fired where the row says — the process died by SIGKILL and printed
its failpoint's line, and the ledger/outbox/Jobs at death are the row's state — and then the row's
outcome: the same terminal phase and step results as a control run of the same steps, one real
execution per effect (at a counter that does not deduplicate where the row is about duplicates),
terminal within the bound measured from submission, and the row's own behaviour.
`make mutants` switches off each mechanism in turn and checks that a row here fails.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass

import psycopg
import pytest
import yaml

from e2e.rig.controlplane import PodEnd
from e2e.system import POLICY_NOT_CONFIGURED, request_requeue, task_manifest, wait_for
from retex.kube.objects import job_name
from tests.cluster.gates import gate_step
from tests.cluster.test_operator import status, task

pytestmark = pytest.mark.slow

TERMINAL = ("Succeeded", "Failed", "Cancelled", "NeedsAttention")
LEASE_SECONDS = 5
LEASE = {"durationSeconds": LEASE_SECONDS}
# Every step's timeoutSeconds: an attempt that finds a step begun by an earlier one may wait out
# that step's timeout before resolving it, so rows stay short only with a short one.
STEP_TIMEOUT = 5


def bound(lease_seconds: int = LEASE_SECONDS) -> float:
    """Submission → terminal: a control run takes ~10 s here; a crash costs at most a lease
    duration and a step timeout more, once for the fault and once more for a slow 2-core machine."""
    return 60 + 2 * (lease_seconds + STEP_TIMEOUT)


def order_steps(payments, notifier, **overrides) -> list[dict]:
    """charge (idempotent at the provider), ship (verifiable), notify (neither), email (exec)."""
    steps = [
        {"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge"}, "idempotent": True},
        {"name": "ship", "http": {"method": "POST", "url": f"{payments.url}/effects/ship"},
         "verify": {"http": {"method": "GET", "url": f"{payments.url}/effects/ship"}}},
        {"name": "notify", "http": {"method": "POST", "url": f"{notifier.url}/effects/notify"}},
        {"name": "email", "exec": {"command": ["sh", "-c", "sleep 1; echo sent"]}, "idempotent": True},
    ]
    for step in steps:
        step["timeoutSeconds"] = STEP_TIMEOUT
        step.update(overrides.get(step["name"], {}))
    return steps


def exec_step(name: str, seconds: float) -> dict:
    return {"name": name, "exec": {"command": ["sh", "-c", f"sleep {seconds}"]}, "idempotent": True,
            "timeoutSeconds": max(STEP_TIMEOUT, int(seconds) + 5)}


@dataclass(frozen=True)
class Submitted:
    name: str
    uid: str
    at: float  # time.monotonic() just before the create: the bounds run from here


def submit(system, name, steps, failpoint=None, **spec) -> Submitted:
    manifest = yaml.safe_load(task_manifest(name, steps, **spec))
    if failpoint:
        manifest["metadata"]["annotations"] = {"retex.dev/failpoint": failpoint}
    at = time.monotonic()

    def created():
        # Right after an API-server restart (the chaos nemesis) the TaskPolicy admission has not
        # found its kind yet and refuses every Task ("failed to configure policy", failurePolicy
        # Fail): a client tries again, as a user re-running kubectl would. Any other refusal fails.
        done = system.kubectl("create", "-f", "-", input=json.dumps(manifest), check=False)
        if done.returncode != 0 and POLICY_NOT_CONFIGURED not in done.stderr:
            raise AssertionError(f"kubectl create {name}: {done.stderr}")
        return done.returncode == 0
    wait_for(created, timeout=30, what=f"{name} created")
    uid = wait_for(lambda: (task(system, name) or {}).get("metadata", {}).get("uid"), timeout=10, what="uid")
    return Submitted(name, uid, at)


def settle(system, submitted: Submitted, phases=TERMINAL, lease_seconds: int = LEASE_SECONDS) -> dict:
    """Wait until the task's status shows one of `phases` within the bound from its submission."""
    def shown():
        s = status(system, submitted.name)
        return s if s.get("phase") in phases else None

    return wait_for(shown, timeout=max(submitted.at + bound(lease_seconds) - time.monotonic(), 0.1),
                    what=f"{submitted.name} in {phases} within {bound(lease_seconds)}s of submission")


def outcome(system, uid) -> tuple[str, list]:
    """Phase and per-step (name, state, result) from the ledger, results made run-independent."""
    record = system.ledger.get(uid)

    def normal(result):
        if isinstance(result, dict):
            return {k: normal(v) for k, v in result.items() if k != "verified"}
        return result

    return str(record.phase), [(s.name, str(s.state), normal(s.result)) for s in record.steps]


def control(system, steps, **spec) -> tuple[str, list]:
    submitted = submit(system, "control", steps, **spec)
    settle(system, submitted)
    return outcome(system, submitted.uid)


def assert_exactly_once(stub_counts: dict, effects=("charge", "ship", "notify")):
    assert {e: stub_counts.get(e, {}).get("executions") for e in effects} == {e: 1 for e in effects}, stub_counts


def effects_of(payments, notifier, uid):
    return {**payments.for_task(uid), **notifier.for_task(uid)}


def job_names(system, uid) -> list[str]:
    out = system.kubectl("get", "jobs", "-l", f"retex.dev/task-uid={uid}", "-o", "json").stdout
    return sorted(j["metadata"]["name"] for j in json.loads(out)["items"])


def outbox(system, uid) -> list[tuple[int, str | None]]:
    """(epoch, outcome) of the task's outbox records; outcome None = not sent yet."""
    with psycopg.connect(system.dsn) as conn:
        rows = conn.execute("SELECT epoch, outcome FROM retex.outbox WHERE task_uid = %s ORDER BY id", (uid,))
        return [tuple(r) for r in rows.fetchall()]


def ledger_phase(system, name) -> str | None:
    """The task's phase in the ledger; None until it is admitted."""
    record = system.ledger.find(system.namespace, name)
    return record and str(record.phase)


def commits_by_epoch(system, uid) -> dict[int, list[int]]:
    by_epoch: dict[int, list[int]] = {}
    for h in system.ledger.history(uid):
        if h.event == "step-commit":
            by_epoch.setdefault(h.epoch, []).append(h.step_idx)
    return by_epoch


def begun_by_epoch(system, uid) -> dict[int, list[int]]:
    by_epoch: dict[int, list[int]] = {}
    for h in system.ledger.history(uid):
        if h.event == "step-begin":
            by_epoch.setdefault(h.epoch, []).append(h.step_idx)
    return by_epoch


def fired(spec: str, submitted: Submitted) -> str:
    """The start of the line retex.failpoints prints just before the signal (it names the spec
    without its action)."""
    return f"retex failpoint {spec.partition('=')[0]} fired: task={submitted.name} uid={submitted.uid} "


def operator_died_at(system, spec: str, submitted: Submitted) -> None:
    """The operator died by SIGKILL, at this failpoint, for this task."""
    wait_for(lambda: system.operator.exited() is not None, timeout=30, what=f"operator to die at {spec}")
    code = system.operator.exited()
    assert code == -signal.SIGKILL, f"operator exit {code}, not SIGKILL"
    lines = [line for line in system.operator.log_path.read_text(errors="replace").splitlines()
             if line.startswith("retex failpoint ")]
    assert len(lines) == 1 and lines[0].startswith(fired(spec, submitted)) and lines[0].endswith(": SIGKILL"), lines


# -- worker pods, read from the node agents' records: a replaced attempt's Job (and pod) is deleted --


def attempt_pods(system, submitted: Submitted, epoch: int) -> list[PodEnd]:
    return system.rig.pod_ends(system.namespace, job_name(submitted.name, submitted.uid, epoch))


def worker_died_at(system, spec: str, submitted: Submitted) -> PodEnd:
    """Attempt 1's worker died by SIGKILL (exit 137), at this failpoint, for this task."""
    def ended():
        return next((p for p in attempt_pods(system, submitted, 1) if p.exit_code is not None), None)

    end = wait_for(ended, timeout=60, what=f"attempt 1's worker to die at {spec}")
    assert end.exit_code == 128 + signal.SIGKILL, f"{end.pod} exited {end.exit_code}, not SIGKILL:\n{end.log[-2000:]}"
    lines = [line for line in end.log.splitlines() if line.startswith("retex failpoint ")]
    assert len(lines) == 1 and lines[0].startswith(fired(spec, submitted)) and lines[0].endswith(": SIGKILL"), \
        end.log[-2000:]
    return end


def crash_worker_at(system, point: str, steps: list, lease: dict = LEASE) -> tuple[Submitted, tuple[str, list]]:
    """The control task with these steps, then the crash task whose attempt 1 is proved to have died
    at `point` (SIGKILL and the failpoint's line). Returns the crash task and the control's outcome."""
    expected = control(system, steps, lease=lease)
    crash = submit(system, "crash", steps, failpoint=point, lease=lease)
    worker_died_at(system, point, crash)
    return crash, expected


# -- operator side ------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "point"), [("R1", "before-admit"), ("R2", "after-admit"),
                                            ("R3", "after-job-create")])
def test_R1_R2_R3_operator_killed_around_admission_and_dispatch_converges_to_one_task_and_one_job(
        retex, stubs, gates, row, point):
    payments, notifier = stubs
    expected = control(retex, [gate_step(gates(opened_now=True)), *order_steps(payments, notifier)])
    spec = f"{point}@crash"  # scoped: kopf resumes the finished control task on restart, and it must pass
    retex.operator.restart(RETEX_FAILPOINT=spec)
    # The gate keeps the crash task Running until the restarted relay has dealt with its record,
    # so R3's record is sent again (not found stale) and meets the Job that already exists.
    gate = gates(opened_now=False)
    crash = submit(retex, "crash", [gate_step(gate), *order_steps(payments, notifier)])
    operator_died_at(retex, spec, crash)
    in_ledger = retex.ledger.find(retex.namespace, "crash") is not None
    jobs_at_death = job_names(retex, crash.uid)
    at_death = {"ledger row": in_ledger, "outbox": outbox(retex, crash.uid), "jobs": len(jobs_at_death)}
    assert at_death == {
        "R1": {"ledger row": False, "outbox": [], "jobs": 0},
        "R2": {"ledger row": True, "outbox": [(1, None)], "jobs": 0},
        "R3": {"ledger row": True, "outbox": [(1, None)], "jobs": 1},
    }[row]
    retex.operator.start()
    wait_for(lambda: outbox(retex, crash.uid) == [(1, "sent")], timeout=60, what="the record sent after the restart")
    gate.open()
    settle(retex, crash)
    assert outcome(retex, crash.uid) == expected
    assert_exactly_once(effects_of(payments, notifier, crash.uid))
    assert [a.epoch for a in retex.ledger.attempts(crash.uid)] == [1], "one attempt: the crash cost nothing"
    jobs = job_names(retex, crash.uid)
    assert len(jobs) == 1 and jobs == (jobs_at_death or jobs), f"one Job, a repeated dispatch met AlreadyExists: {jobs}"


def test_R4_operator_killed_while_mirroring_status_recomputes_it_and_it_never_goes_backwards(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    steps.insert(2, exec_step("pack", 8))  # long enough for the restarts to land mid-run
    expected = control(retex, steps)
    crash = submit(retex, "crash", steps)
    shown: list[tuple[str, int]] = []  # (operator life, ledgerVersion) sampled from submission to the end
    life = "first"

    def sample() -> dict:
        s = status(retex, "crash")
        if "ledgerVersion" in s:
            shown.append((life, s["ledgerVersion"]))
        return s

    # The first operator mirrors the run for a while; then one armed for this task dies at its
    # next mirror of it, mid-run; a third recomputes the status from the ledger.
    wait_for(lambda: [st.get("state") for st in sample().get("steps") or []][:1] == ["done"], timeout=60,
             what="charge shown done")
    life = "armed"
    retex.operator.restart(RETEX_FAILPOINT="in-status-mirror@crash")
    wait_for(lambda: sample() is not None and retex.operator.exited() is not None, timeout=30,
             what="operator to die mirroring")
    operator_died_at(retex, "in-status-mirror@crash", crash)
    # It died mid-run with a newer status in hand: what is shown lags the ledger (the worker,
    # meanwhile, goes on without the operator).
    at_death = sample()
    assert at_death["phase"] == "Running" and at_death["ledgerVersion"] < retex.ledger.get(crash.uid).version
    life = "after"
    retex.operator.start()
    wait_for(lambda: sample().get("phase") == "Succeeded" and shown[-1][1] == retex.ledger.get(crash.uid).version,
             timeout=crash.at + bound() - time.monotonic(), what="the final status shown")
    versions = [v for _, v in shown]
    assert versions == sorted(versions), f"status went backwards: {shown}"
    assert {life for life, _ in shown} >= {"first", "after"}, f"sampled before the kill and after: {shown}"
    assert outcome(retex, crash.uid) == expected
    assert_exactly_once(effects_of(payments, notifier, crash.uid))


def test_R4_an_older_status_never_overwrites_a_newer_one(retex, stubs):
    """The mirror writes only a newer ledgerVersion and the API server refuses a lower one: an older
    writer (a second operator, a patch delayed in flight) can never roll the shown status back. (A
    status *ahead* of the ledger is no newer writer's: the ledger lost commits, and the task is
    frozen; rows R19 and R20.)"""
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    steps.insert(0, exec_step("pack", 4))
    crash = submit(retex, "crash", steps)
    wait_for(lambda: [st.get("state") for st in status(retex, "crash").get("steps") or []][:1] == ["started"],
             timeout=60, what="pack shown started")
    older = status(retex, "crash")
    wait_for(lambda: status(retex, "crash").get("phase") == "Succeeded", timeout=crash.at + bound() - time.monotonic(),
             what="the task shown Succeeded")
    newer = status(retex, "crash")
    assert newer["ledgerVersion"] > older["ledgerVersion"]
    refused = retex.kubectl("patch", "task", "crash", "--subresource=status", "--type=merge",
                            "-p", json.dumps({"status": older}), check=False)
    assert refused.returncode != 0 and "ledgerVersion never goes backwards" in refused.stderr, refused.stderr
    # Every resync (5 s) marks lagging tasks again: over two resyncs an older write would have landed.
    deadline = time.monotonic() + 2 * 5 + 2
    while time.monotonic() < deadline:
        shown = status(retex, "crash")
        assert (shown.get("ledgerVersion"), shown.get("phase")) == (newer["ledgerVersion"], "Succeeded"), (
            "an older status overwrote a newer one")
        time.sleep(0.5)


# -- worker side ----------------------------------------------------------------------------------


def test_R5_worker_killed_holding_the_lease_before_any_step_is_replaced_once_its_pod_is_seen_dead(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    # A lease long enough for kubelet's report of the terminated pod to land before it expires (on
    # a loaded kind node that took over 5 s once): the row is about seeing the death, and a death
    # seen is replaced at once whatever the duration.
    lease_seconds = 15
    crash, expected = crash_worker_at(retex, "after-lease", steps, lease={"durationSeconds": lease_seconds})
    settle(retex, crash, lease_seconds=lease_seconds)
    assert begun_by_epoch(retex, crash.uid).get(1) is None, "attempt 1 died before beginning any step"
    assert outcome(retex, crash.uid) == expected
    assert_exactly_once(effects_of(payments, notifier, crash.uid))
    attempts = retex.ledger.attempts(crash.uid)
    assert [(a.epoch, a.outcome) for a in attempts] == [(1, "lost"), (2, "succeeded")]
    # Not the lease's expiry (a silent death, R11): a late renewal and the pod reported terminated.
    assert attempts[1].cause == "disruption", "the reaper saw the holder's pod terminated"
    assert "lease holder's pod terminated: not waiting for the lease to expire" in \
        retex.operator.log_path.read_text(errors="replace")
    record = retex.ledger.get(crash.uid)
    assert (record.epoch, record.failures, record.disruptions) == (2, 0, 1), "a disruption, not a failure"
    assert commits_by_epoch(retex, crash.uid) == {2: [0, 1, 2, 3]}


@pytest.mark.parametrize(("row", "point"), [
    ("R6-idempotent", "after-effect:charge"),
    ("R6-verify", "after-effect:ship"),
])
def test_R6_worker_killed_before_its_commit_landed_the_next_attempt_resolves_the_started_step(
        retex, stubs, row, point):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    crash, expected = crash_worker_at(retex, point, steps)
    settle(retex, crash)
    died_in = 1 if row == "R6-verify" else 0
    # Where attempt 1 died: it began the step and its commit never landed.
    assert begun_by_epoch(retex, crash.uid)[1] == list(range(died_in + 1))
    assert commits_by_epoch(retex, crash.uid).get(1, []) == list(range(died_in))
    assert outcome(retex, crash.uid) == expected
    counts = effects_of(payments, notifier, crash.uid)
    assert_exactly_once(counts)
    record = retex.ledger.get(crash.uid)
    assert (record.epoch, record.failures, record.disruptions) == (2, 0, 1)
    assert sorted(commits_by_epoch(retex, crash.uid)[2]) == list(range(died_in, 4))
    if row == "R6-idempotent":
        # Not committed: the step ran again with the same key, and the provider replayed it.
        assert begun_by_epoch(retex, crash.uid)[2][0] == 0
        assert counts["charge"] == {"deliveries": 2, "executions": 1}
    else:
        assert counts["ship"] == {"deliveries": 1, "executions": 1}, "verify found it: the step was not sent again"
        assert record.steps[1].result.get("verified") is True


def test_R8_the_commit_transaction_dies_with_the_operator_and_the_worker_sends_its_commit_again(retex, stubs):
    """The commit transaction runs in the operator's ledger endpoint (workers hold no DSN): the
    process that dies inside it is the operator. The transaction rolls back; the worker, alive and
    holding its Lease, retries the same fenced commit once the operator is back."""
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    expected = control(retex, steps, lease=LEASE)
    spec = "in-commit:charge@crash"
    retex.operator.restart(RETEX_FAILPOINT=spec)
    crash = submit(retex, "crash", steps, lease=LEASE)
    operator_died_at(retex, spec, crash)
    # At death: attempt 1 began charge, and its commit was rolled back with the transaction.
    assert begun_by_epoch(retex, crash.uid) == {1: [0]}
    assert commits_by_epoch(retex, crash.uid) == {}
    retex.operator.start()
    settle(retex, crash)
    assert outcome(retex, crash.uid) == expected
    counts = effects_of(payments, notifier, crash.uid)
    assert_exactly_once(counts)
    assert counts["charge"] == {"deliveries": 1, "executions": 1}, "only the commit was sent again, not the step"
    assert [a.epoch for a in retex.ledger.attempts(crash.uid)] == [1], "the worker rode out the operator's death"
    assert commits_by_epoch(retex, crash.uid) == {1: [0, 1, 2, 3]}


@pytest.mark.parametrize("step", ["notify", "charge"])
def test_R8b_the_reply_to_a_begin_is_lost_and_the_worker_runs_the_step_once_without_flagging_it(retex, stubs, step):
    """The operator commits a worker's begin_step and dies before it replies. The worker sends the
    same begin again (the same request id): the restarted endpoint answers with the state the
    step had before that begin, so the step runs once as if the reply had arrived — not judged
    an interrupted step of its own attempt (for `notify`, neither idempotent nor verifiable, that
    would stop the task for a human although nothing was sent)."""
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    expected = control(retex, steps, lease=LEASE)
    spec = f"after-begin-commit:{step}@crash"
    retex.operator.restart(RETEX_FAILPOINT=spec)
    crash = submit(retex, "crash", steps, lease=LEASE)
    operator_died_at(retex, spec, crash)
    idx = [s["name"] for s in steps].index(step)
    # At death: the begin of `step` is committed, nothing of it ran.
    assert begun_by_epoch(retex, crash.uid) == {1: list(range(idx + 1))}
    assert commits_by_epoch(retex, crash.uid) == ({1: list(range(idx))} if idx else {})
    assert effects_of(payments, notifier, crash.uid).get(step, {}).get("deliveries", 0) == 0
    retex.operator.start()
    settle(retex, crash)
    assert outcome(retex, crash.uid) == expected
    counts = effects_of(payments, notifier, crash.uid)
    assert_exactly_once(counts)
    assert counts[step] == {"deliveries": 1, "executions": 1}, "run once, not verified, not re-sent"
    assert [a.epoch for a in retex.ledger.attempts(crash.uid)] == [1], "the worker rode out the operator's death"
    assert begun_by_epoch(retex, crash.uid) == {1: [0, 1, 2, 3]}
    worker_log = "".join(end.log for end in retex.rig.pod_ends(retex.namespace, job_name("crash", crash.uid, 1)))
    assert "lease acquired" in worker_log, "the attempt's worker output is read"
    assert "step was begun and never recorded" not in worker_log, "the step was judged interrupted"
    # The begin waited out the operator's death: the run's start is recorded again before it runs,
    # so a later attempt would wait out this run's deadline, and the run gets its whole timeout.
    assert [h.step_idx for h in retex.ledger.history(crash.uid) if h.event == "step-run"] == [idx]


def test_R7_worker_killed_after_a_commit_never_runs_the_committed_step_again(retex, stubs):
    payments, notifier = stubs
    # The charge goes to the notifier, which executes every delivery: a re-run would count twice.
    steps = order_steps(payments, notifier, charge={"http": {"method": "POST", "url": f"{notifier.url}/effects/charge"}})
    crash, expected = crash_worker_at(retex, "after-commit:charge", steps)
    settle(retex, crash)
    assert begun_by_epoch(retex, crash.uid)[1] == [0] and commits_by_epoch(retex, crash.uid)[1] == [0]
    assert outcome(retex, crash.uid) == expected
    counts = effects_of(payments, notifier, crash.uid)
    assert counts["charge"] == {"deliveries": 1, "executions": 1}, counts
    assert_exactly_once(counts)
    assert begun_by_epoch(retex, crash.uid)[2] == [1, 2, 3], "attempt 2 resumed after the done prefix"
    record = retex.ledger.get(crash.uid)
    assert (record.epoch, record.failures, record.disruptions) == (2, 0, 1)


def test_R9_worker_killed_after_the_last_commit_the_next_attempt_executes_nothing(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    crash, expected = crash_worker_at(retex, "before-complete", steps)
    settle(retex, crash)
    assert commits_by_epoch(retex, crash.uid) == {1: [0, 1, 2, 3]}, "attempt 1 committed all four, attempt 2 none"
    assert 2 not in begun_by_epoch(retex, crash.uid)
    assert outcome(retex, crash.uid) == expected
    counts = effects_of(payments, notifier, crash.uid)
    assert_exactly_once(counts)
    assert all(c == {"deliveries": 1, "executions": 1} for c in counts.values()), counts
    record = retex.ledger.get(crash.uid)
    assert (record.epoch, record.failures, record.disruptions) == (2, 0, 1)
    assert [h.epoch for h in retex.ledger.history(crash.uid) if h.event == "succeed"] == [2]


def test_R6_a_step_neither_idempotent_nor_verifiable_stops_for_a_human_and_never_reruns(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    crash, expected = crash_worker_at(retex, "after-effect:notify", steps)
    shown = settle(retex, crash, phases=("NeedsAttention",))
    assert {c["type"]: c["status"] for c in shown["conditions"]}["NeedsAttention"] == "True"
    assert notifier.for_task(crash.uid)["notify"] == {"deliveries": 1, "executions": 1}, "zero extra executions"
    key = retex.ledger.get(crash.uid).steps[2].idempotency_key
    # The human checks the notifier, finds the effect, and marks the step done with what it said.
    retex.ledger.resolve_step(crash.uid, "notify", mark_done=True,
                              result={"status": 200, "body": notifier.stored("notify", key)}, actor="cli:test")
    wait_for(lambda: status(retex, "crash").get("phase") == "Succeeded", timeout=60, what="Succeeded after resolve")
    assert outcome(retex, crash.uid) == expected
    assert_exactly_once(effects_of(payments, notifier, crash.uid))


def duplicate_job(system, uid, epoch, name):
    """A second Job for the same attempt: the same pod template under another name."""
    job = json.loads(system.kubectl("get", "job", "-l", f"retex.dev/task-uid={uid},retex.dev/epoch={epoch}",
                                    "-o", "json").stdout)["items"][0]
    template = job["spec"]["template"]
    for key in ("controller-uid", "batch.kubernetes.io/controller-uid", "job-name", "batch.kubernetes.io/job-name"):
        template["metadata"]["labels"].pop(key, None)
    copy = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": template}}
    system.kubectl("create", "-f", "-", input=json.dumps(copy))


def pod_exit_code(system, job_name):
    def terminated():
        out = json.loads(system.kubectl("get", "pods", "-l", f"job-name={job_name}", "-o", "json").stdout)
        for pod in out["items"]:
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                state = container.get("state", {}).get("terminated")
                if state:
                    return str(state["exitCode"])
        return None

    return int(wait_for(terminated, timeout=60, what=f"{job_name} pod to exit"))


def pod_log(system, job: str) -> str:
    """What the pods of `job` printed."""
    return "".join(end.log for end in system.rig.pod_ends(system.namespace, job))


def test_R10_a_second_pod_for_the_attempt_never_executes_and_the_first_goes_on(retex, stubs, gates):
    """A duplicate Job's pod (same template, another name) is no worker of the attempt: the ledger
    endpoint refuses it before it touches the Lease. Two pods of the operator's own Job are decided
    by the Lease (test_worker_lease.py::test_two_pods_for_one_attempt_…)."""
    payments, notifier = stubs
    steps = order_steps(payments, notifier, charge={"http": {"method": "POST", "url": f"{notifier.url}/effects/charge"},
                                                    "idempotent": False})
    gate = gates(opened_now=False)
    steps.insert(0, gate_step(gate))
    crash = submit(retex, "crash", steps, lease=LEASE)
    holder = wait_for(lambda: (status(retex, "crash").get("lease") or {}).get("holder"), timeout=60, what="lease taken")
    duplicate_job(retex, crash.uid, 1, "crash-duplicate")
    # The gate holds the task Running until the duplicate has ended: it met a live attempt.
    assert pod_exit_code(retex, "crash-duplicate") == 2, pod_log(retex, "crash-duplicate")[-2000:]
    log = pod_log(retex, "crash-duplicate")
    assert "the ledger endpoint refused this worker" in log and "is not a worker of task" in log, log[-2000:]
    assert "lease acquired" not in log
    assert status(retex, "crash")["phase"] == "Running" and status(retex, "crash")["lease"]["holder"] == holder
    gate.open()
    settle(retex, crash, phases=("Succeeded",))
    assert_exactly_once(effects_of(payments, notifier, crash.uid))
    assert effects_of(payments, notifier, crash.uid)["charge"] == {"deliveries": 1, "executions": 1}
    assert retex.ledger.get(crash.uid).epoch == 1
    assert len(retex.ledger.attempts(crash.uid)) == 1


def test_R11_a_zombie_frozen_after_its_effect_is_fenced_when_it_resumes_after_the_next_epoch_committed(
        retex, stubs):
    payments, notifier = stubs
    # The reaper deletes the zombie's Job; a long grace keeps its pod from being SIGKILLed before
    # the test resumes it (the SIGTERM waits, pending, while it is stopped).
    retex.operator.restart(RETEX_WORKER_GRACE_SECONDS="300")
    # notify: not idempotent, counted at the notifier (which executes every delivery); its verify
    # lets attempt 2 commit it without running it again.
    steps = order_steps(payments, notifier, notify={
        "verify": {"http": {"method": "GET", "url": f"{notifier.url}/effects/notify"}}})
    spec = "after-effect:notify=stop"
    crash = submit(retex, "crash", steps, failpoint=spec, lease=LEASE)
    frozen = wait_for(lambda: next((p for p in attempt_pods(retex, crash, 1) if fired(spec, crash) in p.log), None),
                      timeout=60, what="attempt 1 frozen after notify's effect")
    assert [line for line in frozen.log.splitlines() if line.startswith("retex failpoint ")][-1].endswith(": SIGSTOP")
    # A worker that is its container's PID 1 cannot stop itself: it holds at the point, and is
    # frozen here from outside (on the rig, where it stopped itself, this changes nothing).
    retex.rig.pause_pod(retex.namespace, frozen.pod)
    assert frozen.exit_code is None, "alive, frozen"
    assert notifier.for_task(crash.uid)["notify"] == {"deliveries": 1, "executions": 1}
    settle(retex, crash, phases=("Succeeded",))
    assert commits_by_epoch(retex, crash.uid) == {1: [0, 1], 2: [2, 3]}, "attempt 2 committed notify (verified)"
    assert retex.ledger.attempts(crash.uid)[1].cause == "lease-expired", "a frozen pod is a silent loss"
    assert retex.ledger.get(crash.uid).steps[2].result.get("verified") is True
    version, history = retex.ledger.get(crash.uid).version, retex.ledger.history(crash.uid)

    retex.rig.resume_pod(retex.namespace, frozen.pod)  # the zombie goes on: commit notify, then the rest
    zombie = wait_for(lambda: next((p for p in attempt_pods(retex, crash, 1) if p.exit_code is not None), None),
                      timeout=60, what="the zombie to exit")
    assert zombie.exit_code == 3, f"exit {zombie.exit_code}, not 3 (stale):\n{zombie.log[-3000:]}"
    # On kind the replaced attempt's pod is already being deleted: once its container exits the
    # kubelet may remove it, and its log, before the pod watch reads it (seen once in CI). Then
    # exit 3 and the unchanged ledger below are the proof.
    if not zombie.log.startswith("unable to retrieve container logs"):
        assert '"msg": "fenced: stopping at once"' in zombie.log, zombie.log[-3000:]
    assert notifier.for_task(crash.uid)["notify"] == {"deliveries": 1, "executions": 1}, "no second effect"
    assert retex.ledger.get(crash.uid).version == version, "the zombie wrote nothing"
    assert retex.ledger.history(crash.uid) == history
    assert_exactly_once(effects_of(payments, notifier, crash.uid))


def test_R12_a_stale_pod_after_the_task_is_terminal_exits_with_no_side_effects(retex, stubs):
    payments, notifier = stubs
    crash = submit(retex, "crash", order_steps(payments, notifier))
    settle(retex, crash, phases=("Succeeded",))
    before = effects_of(payments, notifier, crash.uid)
    version = retex.ledger.get(crash.uid).version
    [name] = job_names(retex, crash.uid)  # still there: ttlSecondsAfterFinished is 600
    # The attempt's own Job sent again after it was gone (a late relay, a restored backup): its new
    # pod is a genuine worker of attempt 1, and finds the task over.
    job = json.loads(retex.kubectl("get", "job", name, "-o", "json").stdout)
    retex.kubectl("delete", "job", name, "--cascade=foreground", "--wait=true")
    template = job["spec"]["template"]
    for key in ("controller-uid", "batch.kubernetes.io/controller-uid", "job-name", "batch.kubernetes.io/job-name"):
        template["metadata"]["labels"].pop(key, None)
    again = {"apiVersion": "batch/v1", "kind": "Job",
             "metadata": {k: job["metadata"][k] for k in ("name", "labels", "ownerReferences")},
             "spec": {"backoffLimit": 0, "template": template}}
    retex.kubectl("create", "-f", "-", input=json.dumps(again))
    assert pod_exit_code(retex, name) == 3, pod_log(retex, name)[-2000:]
    assert "task is Succeeded at epoch 1" in pod_log(retex, name)
    assert effects_of(payments, notifier, crash.uid) == before
    assert retex.ledger.get(crash.uid).version == version, "terminal is not re-entrant"


# -- platform ---------------------------------------------------------------------------------------


def test_R13_an_evicted_pod_hands_over_at_once_without_using_the_retry_budget(retex, stubs):
    payments, notifier = stubs
    long_lease = {"durationSeconds": 60}
    steps = order_steps(payments, notifier)
    steps.insert(3, exec_step("pack", 4))
    expected = control(retex, steps, lease=long_lease)
    crash = submit(retex, "crash", steps, lease=long_lease)
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][3:4] == ["started"],
             timeout=60, what="pack running")
    pod = status(retex, "crash")["lease"]["holder"].rsplit(":", 1)[0]
    evicted_at = time.monotonic()
    retex.rig.kubectl("create", "--raw", f"/api/v1/namespaces/{retex.namespace}/pods/{pod}/eviction", "-f", "-",
                      input=json.dumps({"apiVersion": "policy/v1", "kind": "Eviction",
                                        "metadata": {"name": pod, "namespace": retex.namespace}}))
    wait_for(lambda: len(retex.ledger.attempts(crash.uid)) >= 2, timeout=40, what="attempt 2")
    assert time.monotonic() - evicted_at < long_lease["durationSeconds"] / 2, "no waiting for the lease to expire"
    assert retex.ledger.attempts(crash.uid)[1].cause == "disruption", "acted on the released lease"
    settle(retex, crash, phases=("Succeeded",), lease_seconds=long_lease["durationSeconds"])
    phase, steps_out = outcome(retex, crash.uid)
    assert phase == expected[0]
    assert [(n, s) for n, s, _ in steps_out] == [(n, s) for n, s, _ in expected[1]]
    record = retex.ledger.get(crash.uid)
    assert (record.failures, record.disruptions) == (0, 1)
    assert_exactly_once(effects_of(payments, notifier, crash.uid))


def test_R14_a_lost_node_is_replaced_on_the_other_node_within_lease_ttl_plus_5s(retex, stubs):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    steps.insert(3, exec_step("pack", 8))
    crash = submit(retex, "crash", steps, lease=LEASE)
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][3:4] == ["started"],
             timeout=60, what="pack running")
    node = retex.ledger.attempts(crash.uid)[0].node
    assert node in retex.rig.nodes
    retex.rig.kill_node(node)
    lost_at = time.monotonic()
    try:
        wait_for(lambda: (retex.ledger.attempts(crash.uid)[-1].epoch >= 2 and retex.ledger.attempts(crash.uid)[-1].node),
                 timeout=LEASE_SECONDS + 5 + 10, what="attempt 2 running")
        took = time.monotonic() - lost_at
        replacement = retex.ledger.attempts(crash.uid)[-1]
        assert replacement.node != node
        assert took <= LEASE_SECONDS + 5, f"replacement took {took:.1f}s"
        settle(retex, crash, phases=("Succeeded",))
    finally:
        retex.rig.restart_node(node)
    assert_exactly_once(effects_of(payments, notifier, crash.uid))
    assert retex.ledger.get(crash.uid).failures == 0


def _postmaster_started(postgres):
    with psycopg.connect(postgres.dsn()) as conn:
        return conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0]


def test_R15_a_postgres_restart_mid_run_loses_and_duplicates_nothing(retex, stubs, postgres):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    steps.insert(2, exec_step("pack", 3))
    expected = control(retex, steps)
    crash = submit(retex, "crash", steps)
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][2:3] == ["started"],
             timeout=60, what="pack running")
    before = _postmaster_started(postgres)
    postgres.restart()
    assert _postmaster_started(postgres) > before, "Postgres really restarted"
    assert retex.ledger.get(crash.uid).phase == "Running", "mid-run"
    settle(retex, crash, phases=("Succeeded",))
    assert outcome(retex, crash.uid) == expected
    record = retex.ledger.get(crash.uid)
    assert (record.epoch, record.failures, record.disruptions) == (1, 0, 0), "the worker rode out the outage"
    assert commits_by_epoch(retex, crash.uid) == {1: [0, 1, 2, 3, 4]}
    assert_exactly_once(effects_of(payments, notifier, crash.uid))


def test_R16_an_api_server_restart_within_the_lease_ttl_does_not_replace_the_attempt(retex, stubs, gates):
    payments, notifier = stubs
    steps = order_steps(payments, notifier)
    gate = gates(opened_now=False)
    steps.insert(2, gate_step(gate))  # the run spans the whole outage: it goes on once the gate opens
    # A graceful API server restart took up to ~13 s on a loaded 2-core machine: the renew
    # deadline (2/3 of the duration, 30 s here) must outlast it, or the worker rightly gives up.
    crash = submit(retex, "crash", steps, lease={"durationSeconds": 45})
    wait_for(lambda: [s.get("state") for s in status(retex, "crash").get("steps") or []][2:3] == ["started"],
             timeout=60, what="the gate step running")
    restarted = time.monotonic()
    retex.rig.restart_apiserver()
    assert time.monotonic() - restarted < 30, "the restart outlasted the renew deadline: not this row's premise"
    assert retex.ledger.get(crash.uid).phase == "Running" and retex.ledger.get(crash.uid).epoch == 1
    gate.open()
    settle(retex, crash, phases=("Succeeded",), lease_seconds=45)
    assert retex.ledger.get(crash.uid).epoch == 1, "renewals retried; the attempt went on"
    assert_exactly_once(effects_of(payments, notifier, crash.uid))


def test_R17_exhausted_retries_dead_letter_with_no_further_attempts_until_requeued(retex, stubs):
    payments, notifier = stubs
    backoff = {"initialSeconds": 0.1, "maxSeconds": 0.2}
    steps = [{"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge?status=503"},
              "idempotent": True, "timeoutSeconds": STEP_TIMEOUT}]
    crash = submit(retex, "crash", steps, retry={"maxAttempts": 2, "backoff": backoff})
    wait_for(lambda: ledger_phase(retex, "crash") == "Failed", timeout=60, what="Failed in the ledger")
    assert retex.ledger.get(crash.uid).dead_lettered
    # On the ledger, over a window far longer than the backoff (and a promoter round): nothing.
    window_end = time.monotonic() + max(25 * backoff["maxSeconds"], LEASE_SECONDS)
    while time.monotonic() < window_end:
        assert [a.epoch for a in retex.ledger.attempts(crash.uid)] == [1, 2], "no attempt after the dead letter"
        time.sleep(0.25)
    assert payments.for_task(crash.uid)["charge"] == {"deliveries": 2, "executions": 0}
    shown = settle(retex, crash, phases=("Failed",))
    assert {c["type"]: c["status"] for c in shown["conditions"]}["DeadLettered"] == "True"
    request_requeue(retex.kubectl, "crash", "1")
    wait_for(lambda: len(retex.ledger.attempts(crash.uid)) >= 3, timeout=30, what="a fresh attempt")
    wait_for(lambda: retex.ledger.get(crash.uid).phase == "Failed", timeout=60, what="Failed again")


def test_R18_a_permanent_error_fails_at_once_without_retry(retex, stubs):
    payments, notifier = stubs
    steps = [{"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge?status=400"},
              "timeoutSeconds": STEP_TIMEOUT}]
    crash = submit(retex, "crash", steps, retry={"maxAttempts": 5})
    shown = settle(retex, crash, phases=("Failed",))
    assert {c["type"]: c["reason"] for c in shown["conditions"]}["Failed"] == "PermanentError"
    assert retex.ledger.get(crash.uid).epoch == 1
    assert payments.for_task(crash.uid)["charge"] == {"deliveries": 1, "executions": 0}
