"""Chaos: tasks of several steps while a seeded random nemesis kills workers, the operator, a node
agent, Postgres and the API server. At the end every task is Succeeded with each step committed
once, and the stub counted exactly one real execution per idempotency key.

The seed and the schedule are printed, so a failure can be replayed with RETEX_CHAOS_SEED.
CI runs a bounded version; `make chaos` runs a longer one (RETEX_CHAOS_TASKS, RETEX_CHAOS_SECONDS).
"""

from __future__ import annotations

import json
import os
import random
import time

from e2e.system import wait_for
from tests.cluster.test_crash_matrix import effects_of, submit
from tests.cluster.test_operator import status


def chaos_steps(payments) -> list[dict]:
    return [
        {"name": "charge", "http": {"method": "POST", "url": f"{payments.url}/effects/charge"}, "idempotent": True},
        {"name": "ship", "http": {"method": "POST", "url": f"{payments.url}/effects/ship"},
         "verify": {"http": {"method": "GET", "url": f"{payments.url}/effects/ship"}}},
        {"name": "pack", "exec": {"command": ["sh", "-c", "sleep 4; echo packed"]}, "idempotent": True},
        {"name": "invoice", "http": {"method": "POST", "url": f"{payments.url}/effects/invoice"}, "idempotent": True},
    ]


def running_pods(system) -> list[str]:
    out = json.loads(system.kubectl("get", "pods", "-l", "app.kubernetes.io/component=worker", "-o", "json").stdout)
    return [p["metadata"]["name"] for p in out["items"] if (p.get("status") or {}).get("phase") == "Running"]


def test_chaos_every_task_finishes_correctly_with_exactly_once_effects(retex, stubs, postgres):
    payments, _ = stubs
    seed = int(os.environ.get("RETEX_CHAOS_SEED", random.randrange(1 << 30)))
    tasks = int(os.environ.get("RETEX_CHAOS_TASKS", "6"))
    seconds = float(os.environ.get("RETEX_CHAOS_SECONDS", "40"))
    rng = random.Random(seed)
    print(f"chaos seed={seed} tasks={tasks} seconds={seconds}")
    lease = {"durationSeconds": 5}
    uids = {}
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

    nemeses = {
        "kill-worker": kill_worker,
        "kill-operator": kill_operator,
        "kill-node": kill_node,
        "restart-postgres": postgres.restart,
        "restart-apiserver": retex.rig.restart_apiserver,
    }
    started = time.monotonic()
    try:
        while time.monotonic() - started < seconds or len(uids) < tasks:
            if len(uids) < tasks:  # submissions spread over the run, so nemeses meet work in flight
                name = f"chaos-{len(uids)}"
                uids[name] = submit(retex, name, chaos_steps(payments), lease=lease)
            time.sleep(rng.uniform(2.0, 5.0))
            nemesis = rng.choice(sorted(nemeses))
            detail = nemeses[nemesis]()
            schedule.append((round(time.monotonic() - started, 1), nemesis, detail))
            print(f"  t={schedule[-1][0]}s {nemesis} {detail or ''}")
    finally:
        if killed_node:
            retex.rig.restart_node(killed_node)
        if retex.operator.exited() is not None:
            retex.operator.start()
    print(f"chaos schedule (seed {seed}): {schedule}")
    for name in uids:
        wait_for(lambda n=name: status(retex, n).get("phase") in ("Succeeded", "Failed", "NeedsAttention"),
                 timeout=240, what=f"{name} terminal (seed {seed})")
    for name, uid in uids.items():
        record = retex.ledger.get(uid)
        assert record.phase == "Succeeded", f"{name}: {record.phase} {record.last_error} (seed {seed})"
        commits = [h.step_idx for h in retex.ledger.history(uid) if h.event == "step-commit"]
        assert sorted(commits) == [0, 1, 2, 3], f"{name} commits {commits} (seed {seed})"
        counts = effects_of(payments, stubs[1], uid)
        assert {e: c["executions"] for e, c in counts.items()} == {"charge": 1, "ship": 1, "invoice": 1}, \
            f"{name}: {counts} (seed {seed})"
