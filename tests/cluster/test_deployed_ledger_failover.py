"""On kind: the deployed operator (manifests/overlays/dev's Deployment, one replica) runs its
ledger on Patroni as manifests/ledger-patroni deploys it (two members in a StatefulSet, the
Kubernetes DCS, `synchronous_mode: true`, the Service retex-patroni routing to the leader's pod),
and the ledger's primary fails over twice while 30 tasks run: a `patronictl switchover` (kubectl
exec into the leader), then a kill -9 of the new primary's postmaster. The operator's DSN names
the leader's Service alone; each reconnection reaches whichever member leads by then.

First each fault is proved to have fired (the leader in Patroni's DCS changed and the Service's
label followed it; the promoted member's pg_is_in_recovery() flipped to false; the killed
postmaster is gone and left its postmaster.pid, which a clean shutdown removes); then: every task
ended Succeeded, or NeedsAttention only at its step that is neither idempotent nor verifiable; no
effect executed twice at the notifier (which does not deduplicate); every step the ledger held
done, and the standby had on disk, before the kill is still done after it; no task was frozen by
the ledger's witness; and the operator's pod was neither replaced nor restarted.

The twin of test_ledger_failover.py, which runs the same faults on the local rig.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from e2e.rig.external import KindCluster
from e2e.system import discard_namespace, task_manifest, wait_for
from tests.cluster.test_crash_matrix import LEASE, effects_of
from tests.cluster.test_deployed_chaos import onboard_reaching_stubs
from tests.cluster.test_ledger_failover import failover_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "retex-system"
OPERATOR = "deployment/retex-operator"
OPERATOR_PODS = "app.kubernetes.io/component=operator"
SCOPE = "retex-patroni"  # patroni.yml's scope: the StatefulSet, its pods' cluster-name, the DCS ConfigMaps
MEMBERS = f"cluster-name={SCOPE}"
CONFIG = "/etc/patroni/patroni.yml"
PGDATA = "/var/lib/postgresql/data/pgdata"
DSN_SECRET = "retex-patroni-dsn"
TASKS = 30
SETTLE_SECONDS = 600
TERMINAL = ("Succeeded", "Failed", "NeedsAttention")


class Patroni:
    """The StatefulSet's two members, read and struck through the API server and kubectl exec."""

    def __init__(self, rig: KindCluster):
        self.rig = rig

    def _annotations(self, configmap: str) -> dict[str, str]:
        shown = self.rig.kubectl("get", "configmap", "-n", SYSTEM, f"{SCOPE}-{configmap}", "-o", "json", check=False)
        return json.loads(shown.stdout)["metadata"].get("annotations") or {} if shown.returncode == 0 else {}

    def leader(self) -> str | None:
        """The holder of the leader key in the DCS (the ConfigMap retex-patroni-leader)."""
        return self._annotations("leader").get("leader") or None

    def sync_standby(self) -> str | None:
        """The member the leader waits for at each commit (the ConfigMap retex-patroni-sync)."""
        return self._annotations("sync").get("sync_standby") or None

    def labelled_master(self) -> list[str]:
        """The pods the Service retex-patroni routes to."""
        pods = json.loads(self.rig.kubectl("get", "pods", "-n", SYSTEM, "-l", f"{MEMBERS},role=master",
                                           "-o", "json").stdout)["items"]
        return sorted(p["metadata"]["name"] for p in pods)

    def sql(self, member: str, query: str, dbname: str = "retex") -> list[list[str]]:
        """Rows of `query` as the superuser on `member`'s own socket, whatever its role."""
        done = self.rig.kubectl("exec", "-n", SYSTEM, member, "-c", "patroni", "--", "psql", "-h",
                                "/var/run/postgresql", "-U", "postgres", "-d", dbname, "-AtX", "-F", "\t",
                                "-c", query, timeout=30)
        return [line.split("\t") for line in done.stdout.splitlines() if line]

    def in_recovery(self, member: str) -> bool:
        return self.sql(member, "SELECT pg_is_in_recovery()", dbname="postgres") == [["t"]]

    def healthy(self) -> bool:
        """A leader whose synchronous standby streams to it, and the Service routing to the leader."""
        leader, standby = self.leader(), self.sync_standby()
        if not leader or not standby or self.labelled_master() != [leader]:
            return False
        try:
            rows = self.sql(leader, "SELECT count(*) FROM pg_stat_replication "
                                    "WHERE sync_state = 'sync' AND state = 'streaming'", dbname="postgres")
        except subprocess.CalledProcessError:
            return False
        return rows == [["1"]]

    def promoted(self, member: str) -> None:
        """Until `member` leads, takes writes and is the one the Service routes to (Patroni takes
        the leader key before the promotion completes, and relabels the pods after)."""
        def done() -> bool:
            try:
                return self.leader() == member and not self.in_recovery(member) and self.labelled_master() == [member]
            except subprocess.CalledProcessError:
                return False
        wait_for(done, timeout=60, what=f"{member} promoted and labelled role=master", interval=0.5)

    def switchover(self, leader: str, candidate: str) -> None:
        self.rig.kubectl("exec", "-n", SYSTEM, leader, "-c", "patroni", "--", "patronictl", "-c", CONFIG,
                         "switchover", SCOPE, "--leader", leader, "--candidate", candidate, "--force", timeout=90)

    def kill_postmaster(self, member: str) -> tuple[int, int | None]:
        """kill -9 of `member`'s postmaster; returns its pid and the pid postmaster.pid names once
        the process is gone (a zombie counts as gone: its parent reaps it at leisure)."""
        script = f"""
            pid=$(head -n 1 {PGDATA}/postmaster.pid)
            kill -9 "$pid"
            while [ -e /proc/$pid ] && [ "$(cut -d ' ' -f 3 /proc/$pid/stat)" != Z ]; do sleep 0.01; done
            echo "$pid $(head -n 1 {PGDATA}/postmaster.pid 2>/dev/null)"
        """
        done = self.rig.kubectl("exec", "-n", SYSTEM, member, "-c", "patroni", "--", "sh", "-c", script, timeout=30)
        killed, *left = done.stdout.split()
        return int(killed), int(left[0]) if left else None


def deployment_env(rig: KindCluster) -> list[dict]:
    shown = json.loads(rig.kubectl("get", "-n", SYSTEM, OPERATOR, "-o", "json").stdout)
    container = next(c for c in shown["spec"]["template"]["spec"]["containers"] if c["name"] == "operator")
    return container["env"]


def set_deployment_env(rig: KindCluster, env: list[dict]) -> None:
    shown = json.loads(rig.kubectl("get", "-n", SYSTEM, OPERATOR, "-o", "json").stdout)
    index = next(i for i, c in enumerate(shown["spec"]["template"]["spec"]["containers"]) if c["name"] == "operator")
    rig.kubectl("patch", "-n", SYSTEM, OPERATOR, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": f"/spec/template/spec/containers/{index}/env", "value": env}]))


def operator_pods(rig: KindCluster) -> list[dict]:
    pods = json.loads(rig.kubectl("get", "pods", "-n", SYSTEM, "-l", OPERATOR_PODS, "-o", "json").stdout)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


@pytest.fixture
def patroni(rig):
    """manifests/ledger-patroni applied (its image built here and loaded into the nodes), both
    members up; deleted afterwards with its volumes."""
    if not isinstance(rig, KindCluster):
        pytest.skip("the Patroni StatefulSet and the deployed operator need kind (make e2e-kind); "
                    "the rig runs test_ledger_failover")
    started = time.monotonic()
    subprocess.run(["bash", str(REPO / "e2e" / "kind" / "patroni" / "load.sh"), os.environ["RETEX_KIND_CLUSTER"]],
                   check=True, timeout=900)
    rig.kubectl("apply", "-k", str(REPO / "manifests" / "ledger-patroni"))
    cluster = Patroni(rig)
    try:
        rig.kubectl("rollout", "status", "-n", SYSTEM, f"statefulset/{SCOPE}", "--timeout=300s")
        wait_for(cluster.healthy, timeout=180, what="a Patroni leader with a streaming synchronous standby",
                 interval=1)
        print(f"patroni up in {time.monotonic() - started:.0f}s: leader {cluster.leader()}, "
              f"synchronous standby {cluster.sync_standby()}", flush=True)
        yield cluster
    finally:
        for member in ("0", "1"):
            print(f"--- {SCOPE}-{member} log tail ---\n"
                  + rig.kubectl("logs", "-n", SYSTEM, f"{SCOPE}-{member}", "--tail=40", check=False).stdout)
        rig.kubectl("delete", "-k", str(REPO / "manifests" / "ledger-patroni"), "--wait=true", "--timeout=120s",
                    check=False)
        # Patroni's own ConfigMaps (the DCS) and the members' volumes outlive the manifests' objects.
        rig.kubectl("delete", "configmap,pvc", "-n", SYSTEM, "-l", MEMBERS, "--timeout=120s", check=False)


@pytest.fixture
def deployed_on_patroni(rig, stubs, patroni):
    """The deployed operator, one replica, its DSN the Secret retex-patroni-dsn (the leader's
    Service) and watching only a tenant namespace onboarded as a user onboards one, whose workers
    may also reach the stubs; the operator's own Deployment restored afterwards."""
    namespace = f"ledger-failover-{random.randrange(1 << 24):06x}"
    onboard_reaching_stubs(rig, namespace, stubs)
    deployed_env = deployment_env(rig)
    on_patroni = [e for e in deployed_env if e["name"] not in ("RETEX_DATABASE_URL", "RETEX_NAMESPACES")]
    on_patroni += [{"name": "RETEX_DATABASE_URL", "valueFrom": {"secretKeyRef": {"name": DSN_SECRET, "key": "dsn"}}},
                   # the examples' Tasks, whose ledger is the dev Postgres, are not this ledger's
                   {"name": "RETEX_NAMESPACES", "value": namespace}]
    set_deployment_env(rig, on_patroni)
    try:
        rig.kubectl("scale", "-n", SYSTEM, OPERATOR, "--replicas=1")
        rig.kubectl("rollout", "status", "-n", SYSTEM, OPERATOR, "--timeout=180s")
        yield namespace
    finally:
        print("--- operator log tail ---\n" + rig.kubectl("logs", "-n", SYSTEM, OPERATOR, "--tail=60", check=False).stdout)
        rig.kubectl("delete", "tasks", "--all", "-n", namespace, "--timeout=120s", check=False)
        discard_namespace(rig.kubectl, namespace)
        rig.kubectl("scale", "-n", SYSTEM, OPERATOR, "--replicas=0")
        rig.kubectl("wait", "-n", SYSTEM, "--for=delete", "pod", "-l", OPERATOR_PODS, "--timeout=120s", check=False)
        set_deployment_env(rig, deployed_env)


def test_the_deployed_operator_rides_through_a_patroni_switchover_and_a_failover_losing_nothing_and_repeating_nothing(
        rig, stubs, patroni, deployed_on_patroni):
    payments, notifier = stubs
    namespace = deployed_on_patroni
    [operator_before] = operator_pods(rig)
    started = time.monotonic()
    submitted: dict[str, str] = {}
    done_before_kill: set[tuple[str, str]] = set()

    def kubectl(*args, **kwargs):
        return rig.kubectl("-n", namespace, *args, **kwargs)

    def in_flight(leader: str) -> int:
        """Tasks that have begun a step and not finished: what a fault now meets."""
        return int(patroni.sql(leader, "SELECT count(DISTINCT task_uid) FROM retex.steps WHERE state = 'started'")[0][0])

    def switchover() -> str:
        """Fault 1: a switchover to the synchronous standby."""
        wait_for(patroni.healthy, timeout=120, what="a synchronous standby streaming", interval=1)
        first, candidate = patroni.leader(), patroni.sync_standby()
        assert first and candidate and patroni.in_recovery(candidate)
        flying = wait_for(lambda: in_flight(first), timeout=90, what="a task inside a step, for the switchover to meet",
                          interval=1)
        patroni.switchover(first, candidate)
        patroni.promoted(candidate)
        assert patroni.leader() == candidate != first
        return f"{first} -> {candidate} with {flying} tasks in a step"

    def kill_primary() -> str:
        """Fault 2: kill -9 of the (new) primary's postmaster, its synchronous standby streaming."""
        wait_for(patroni.healthy, timeout=180, what="a synchronous standby streaming again", interval=1)
        leader, standby = patroni.leader(), patroni.sync_standby()
        assert leader and standby and patroni.in_recovery(standby)
        done_before_kill.update((uid, idx) for uid, idx in
                                patroni.sql(leader, "SELECT task_uid, idx FROM retex.steps WHERE state = 'done'"))
        [[lsn]] = patroni.sql(leader, "SELECT pg_current_wal_lsn()")  # past every commit that read saw

        def on_standby_disk() -> bool:
            """Acknowledged: what that read saw is on the synchronous standby's disk."""
            return patroni.sql(leader, f"SELECT bool_and(flush_lsn >= '{lsn}'::pg_lsn) FROM pg_stat_replication "
                                       "WHERE sync_state = 'sync'") == [["t"]]
        wait_for(on_standby_disk, timeout=30, what=f"the standby flushed to {lsn}")
        flying = wait_for(lambda: in_flight(leader), timeout=90, what="a task inside a step, for the kill to meet",
                          interval=1)
        killed, named = patroni.kill_postmaster(leader)
        assert named == killed, f"postmaster {killed} shut down cleanly (postmaster.pid names {named}): not killed"
        patroni.promoted(standby)
        assert patroni.leader() == standby != leader
        return f"{leader}'s postmaster {killed} (kill -9) with {len(done_before_kill)} steps done, " \
               f"{flying} tasks in a step; {standby} leads"

    # Submissions go on through both faults, so each meets tasks at every stage.
    faults = {12: switchover, 24: kill_primary}  # after the 12th submission, after the 24th
    for i in range(1, TASKS + 1):
        name = f"failover-{i}"
        kubectl("apply", "-f", "-", input=task_manifest(name, failover_steps(payments, notifier), lease=LEASE))
        submitted[name] = json.loads(kubectl("get", "task", name, "-o", "json").stdout)["metadata"]["uid"]
        if i in faults:
            at = time.monotonic() - started
            detail = faults[i]()
            print(f"t={at:.0f}s-{time.monotonic() - started:.0f}s {faults[i].__name__}: {detail}", flush=True)
        else:
            time.sleep(1)
    assert done_before_kill, "the kill never happened"

    def shown(name: str) -> dict:
        return json.loads(kubectl("get", "task", name, "-o", "json").stdout).get("status") or {}

    for name in submitted:
        wait_for(lambda n=name: shown(n).get("phase") in TERMINAL,
                 timeout=max(started + SETTLE_SECONDS - time.monotonic(), 1), what=f"{name} terminal")
    print(f"every task terminal {time.monotonic() - started:.0f}s after the first submission", flush=True)

    # The operator lived through both faults: the same pod, its container never restarted.
    [operator_after] = operator_pods(rig)
    assert operator_after["metadata"]["uid"] == operator_before["metadata"]["uid"], "the operator's pod was replaced"
    restarts = [c["restartCount"] for c in operator_after["status"]["containerStatuses"]]
    assert restarts == [0], f"the operator's container restarted: {restarts}"

    leader = patroni.leader()
    assert leader
    done_after = {(uid, idx) for uid, idx in
                  patroni.sql(leader, "SELECT task_uid, idx FROM retex.steps WHERE state = 'done'")}
    lost = sorted(done_before_kill - done_after)
    assert not lost, f"steps done before the failover and not after it: {lost}"
    frozen = patroni.sql(leader, "SELECT task_uid, event FROM retex.history WHERE event = 'freeze' UNION ALL "
                                 "SELECT uid, frozen_reason FROM retex.tasks WHERE frozen_reason IS NOT NULL")
    assert not frozen, f"tasks frozen by the ledger's witness: {frozen}"

    names = [s["name"] for s in failover_steps(payments, notifier)]
    phases: dict[str, int] = {}
    for name, uid in submitted.items():
        status = shown(name)
        phases[status["phase"]] = phases.get(status["phase"], 0) + 1
        states = {s["name"]: s["state"] for s in status["steps"]}
        executions = {effect: c["executions"] for effect, c in effects_of(payments, notifier, uid).items()}
        assert all(n <= 1 for n in executions.values()), f"{name}: an effect executed twice: {executions}"
        if status["phase"] == "NeedsAttention":
            flagged = [step for step, state in states.items() if state == "needs-attention"]
            assert flagged == ["notify"], f"{name}: flagged {flagged}: {status}"
            continue
        assert status["phase"] == "Succeeded", f"{name}: {status}"
        assert states == dict.fromkeys(names, "done"), f"{name}: {states}"
        assert executions == {"charge": 1, "notify": 1}, f"{name}: {executions}"
    print(f"phases {phases}; {len(done_before_kill)} steps done before the kill, all still done", flush=True)
