"""Chaos: tasks of several steps while a seeded random nemesis kills workers, the operator, a node
agent, Postgres (or fails the ledger over) and the API server. At the end no task failed; each is Succeeded with every step
committed once, or NeedsAttention at its one step that is neither idempotent nor verifiable; and
no effect executed twice — counted at the notifier, which does not deduplicate, as well as at the
payments stub.

The seed is printed at the start and in every failure message: RETEX_CHAOS_SEED=N replays the same
choices (nemeses, their victims and pauses). `make test` runs a bounded version; `make chaos` runs
a longer one (RETEX_CHAOS_TASKS, RETEX_CHAOS_SECONDS) under its own timeout.

RETEX_CHAOS_LEDGER picks the ledger: `postgres` (the default: the session's single Postgres, which
the nemesis `restart-postgres` restarts) or `patroni` (`make chaos`'s: a Patroni cluster, a primary
and a synchronous standby as in test_ledger_failover.py, which the nemesis `fail-over-ledger`
switches over or whose primary's postmaster it kills with -9, by the seed).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from e2e.system import wait_for
from tests.cluster.conftest import patroni_cluster, retex_on_patroni
from tests.cluster.test_crash_matrix import LEASE, STEP_TIMEOUT, effects_of, submit
from tests.cluster.test_operator import status

TASKS = int(os.environ.get("RETEX_CHAOS_TASKS", "6"))
SECONDS = float(os.environ.get("RETEX_CHAOS_SECONDS", "40"))
LEDGER = os.environ.get("RETEX_CHAOS_LEDGER", "postgres")
SETTLE_SECONDS = 240
# Longer than pytest's per-test 300 s when the run is: the run, the settling, and the rig's start.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SECONDS + SETTLE_SECONDS + 120))]

@pytest.fixture(scope="module")
def patroni(rig):
    """The ledger of RETEX_CHAOS_LEDGER=patroni: a primary and a synchronous standby."""
    with patroni_cluster(rig) as cluster:
        yield cluster


@pytest.fixture
def on_patroni(rig, patroni, tmp_path):
    with retex_on_patroni(rig, patroni, "retex_chaos", "tenant-chaos-patroni", Path(tmp_path) / "operator.log") as system:
        yield system


def chaos_steps(payments, notifier) -> list[dict]:
    """Effects at the deduplicating payments stub, and two at the notifier, which executes every
    delivery: a re-sent effect shows there even when the key is the same."""
    steps = [
        {"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge"}, "idempotent": True},
        {"name": "ship", "http": {"method": "POST", "url": f"{payments.url}/effects/ship"},
         "verify": {"http": {"method": "GET", "url": f"{payments.url}/effects/ship"}}},
        # not idempotent, verifiable: exactly one execution
        {"name": "receipt", "http": {"method": "POST", "url": f"{notifier.url}/effects/receipt"},
         "verify": {"http": {"method": "GET", "url": f"{notifier.url}/effects/receipt"}}},
        {"name": "pack", "exec": {"command": ["sh", "-c", "sleep 4; echo packed"]}, "idempotent": True},
        # neither: exactly one execution, or (interrupted) NeedsAttention with at most one
        {"name": "notify", "http": {"method": "POST", "url": f"{notifier.url}/effects/notify"}},
        {"name": "invoice", "http": {"method": "POST", "url": f"{payments.url}/effects/invoice"}, "idempotent": True},
    ]
    for step in steps:
        step["timeoutSeconds"] = STEP_TIMEOUT
    return steps


def print_ledger_state(system, name: str, uid: str) -> None:
    """What a stuck task looks like from the ledger and the API server, for the failure report."""
    record = system.ledger.get(uid)
    print(f"--- {name}: ledger phase {record.phase} epoch {record.epoch} reason {record.reason} "
          f"last_error {record.last_error!r}; status {status(system, name)}")
    for attempt in system.ledger.attempts(uid):
        print(f"  attempt {attempt}")
    for entry in system.ledger.history(uid)[-25:]:
        print(f"  history {entry.at:%H:%M:%S.%f} {entry.actor} {entry.event} epoch={entry.epoch} "
              f"step={entry.step_idx} {entry.from_state}->{entry.to_state} {entry.detail}")
    print(system.kubectl("get", "jobs,pods,leases", "-o", "wide", check=False).stdout)


def running_pods(system) -> list[str]:
    out = json.loads(system.kubectl("get", "pods", "-l", "app.kubernetes.io/component=worker", "-o", "json").stdout)
    return [p["metadata"]["name"] for p in out["items"] if (p.get("status") or {}).get("phase") == "Running"]


def test_chaos_every_task_finishes_correctly_and_no_effect_executes_twice(request, stubs):
    payments, notifier = stubs
    seed = int(os.environ.get("RETEX_CHAOS_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    print(f"chaos seed={seed} tasks={TASKS} seconds={SECONDS} ledger={LEDGER} "
          f"(replay: RETEX_CHAOS_SEED={seed} RETEX_CHAOS_LEDGER={LEDGER})", flush=True)
    if LEDGER not in ("postgres", "patroni"):
        raise ValueError(f"RETEX_CHAOS_LEDGER={LEDGER!r}: postgres or patroni")
    retex = request.getfixturevalue("on_patroni" if LEDGER == "patroni" else "retex")
    submitted = {}
    schedule = []
    killed_node = None

    def kill_worker():
        pods = running_pods(retex)
        if pods:
            pod = rng.choice(pods)
            retex.kubectl("delete", "pod", pod, "--grace-period=0", "--force", check=False)
            return pod
        return None

    def kill_operator():
        retex.operator.kill()
        time.sleep(rng.uniform(0.5, 2.0))
        retex.operator.start()

    def kill_node():
        nonlocal killed_node
        if killed_node:  # bring the last one back first: never lose both nodes
            retex.rig.restart_node(killed_node)
            killed_node = None
            return "restarted"
        killed_node = rng.choice(retex.rig.nodes)
        retex.rig.kill_node(killed_node)
        return killed_node

    def fail_over_ledger():
        """A switchover to the synchronous standby or a kill -9 of the primary's postmaster; it
        fired when another member leads and has left recovery."""
        cluster = request.getfixturevalue("patroni")
        cluster.wait_healthy()  # a standby to fail over to: the last failover's old primary rejoined
        before = cluster.leader()
        how = rng.choice(["switchover", "kill-primary"])
        if how == "switchover":
            cluster.switchover()
        else:
            assert cluster.kill_primary().pid_file_left, "the postmaster shut down cleanly: it was not killed"
        wait_for(lambda: cluster.leader() not in (None, before), timeout=60, what=f"a leader other than {before}")
        after = cluster.leader()
        wait_for(lambda: not cluster.member(after).in_recovery(), timeout=30, what=f"{after} out of recovery")
        return f"{how} {before} -> {after}"

    nemeses = {
        "kill-worker": kill_worker,
        "kill-operator": kill_operator,
        "kill-node": kill_node,
        "restart-apiserver": retex.rig.restart_apiserver,
    }
    if LEDGER == "patroni":
        nemeses["fail-over-ledger"] = fail_over_ledger
    else:
        nemeses["restart-postgres"] = request.getfixturevalue("postgres").restart
    started = time.monotonic()
    try:
        while time.monotonic() - started < SECONDS or len(submitted) < TASKS:
            if len(submitted) < TASKS:  # submissions spread over the run, so nemeses meet work in flight
                name = f"chaos-{len(submitted)}"
                submitted[name] = submit(retex, name, chaos_steps(payments, notifier), lease=LEASE)
            time.sleep(rng.uniform(2.0, 5.0))
            nemesis = rng.choice(sorted(nemeses))
            detail = nemeses[nemesis]()
            schedule.append((round(time.monotonic() - started, 1), nemesis, detail))
            print(f"  t={schedule[-1][0]}s {nemesis} {detail or ''}", flush=True)
    finally:
        if killed_node:
            retex.rig.restart_node(killed_node)
        if retex.operator.exited() is not None:
            retex.operator.start()
    print(f"chaos schedule (seed {seed}): {schedule}")
    for name, task in submitted.items():
        try:
            wait_for(lambda n=name: status(retex, n).get("phase") in ("Succeeded", "Failed", "NeedsAttention"),
                     timeout=SETTLE_SECONDS, what=f"{name} terminal (seed {seed})")
        except Exception:
            print_ledger_state(retex, name, task.uid)
            raise
    names = [s["name"] for s in chaos_steps(payments, notifier)]
    for name, task in submitted.items():
        record = retex.ledger.get(task.uid)
        counts = effects_of(payments, notifier, task.uid)
        executions = {effect: c["executions"] for effect, c in counts.items()}
        assert all(n <= 1 for n in executions.values()), f"{name}: an effect executed twice: {counts} (seed {seed})"
        commits = sorted(h.step_idx for h in retex.ledger.history(task.uid) if h.event == "step-commit")
        if record.phase == "NeedsAttention":
            # Only `notify` may stop for a human (begun, never recorded, not safe to re-run).
            flagged = [s.name for s in record.steps if str(s.state) == "needs-attention"]
            assert flagged == ["notify"], f"{name}: flagged {flagged}: {record.last_error} (seed {seed})"
            assert commits == list(range(names.index("notify"))), f"{name} commits {commits} (seed {seed})"
            continue
        assert record.phase == "Succeeded", f"{name}: {record.phase} {record.last_error} (seed {seed})"
        assert commits == list(range(len(names))), f"{name} commits {commits} (seed {seed})"
        assert executions == {"charge": 1, "ship": 1, "receipt": 1, "notify": 1, "invoice": 1}, \
            f"{name}: {counts} (seed {seed})"
