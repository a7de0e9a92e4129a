"""Two operator replicas against one rig and one ledger: one leader writes, the standby writes
nothing; SIGKILL or SIGSTOP the leader while tasks run and the standby takes over within the
lease duration + 5 s, every task ends exactly once, and no live worker is replaced.

Both replicas run with the test timings of e2e.system (lease 4 s, renew deadline 3 s, retry
0.5 s). Workers reach the ledger endpoint through one RoundRobinService (the rig's stand-in for
the retex-ledger Service), so a worker's calls reach whichever replica is alive.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import statistics
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import yaml

from e2e.rig import pki as pkilib
from e2e.rig.controlplane import run_kubectl
from e2e.rig.procs import stat_fields
from e2e.service import RoundRobinService, SlowAnswers
from e2e.system import (
    LEADER_ELECTION_FOR_TESTS,
    OperatorProcess,
    discard_namespace,
    install_crd,
    prepare_namespace,
    task_manifest,
    wait_for,
)
from retex.kube.election import ElectionTiming
from retex.ledger import Ledger
from retex.operator.settings import session_limits

LEASE_SECONDS = float(LEADER_ELECTION_FOR_TESTS["RETEX_LEADER_LEASE_SECONDS"])
RENEW_DEADLINE = float(LEADER_ELECTION_FOR_TESTS["RETEX_LEADER_RENEW_DEADLINE_SECONDS"])
RETRY_PERIOD = float(LEADER_ELECTION_FOR_TESTS["RETEX_LEADER_RETRY_SECONDS"])
WRITER_LOOPS = ("relay", "promoter", "reaper", "status-mirror", "status-resync", "event-poster")
_numbers = itertools.count()


@dataclass
class Pair:
    rig: object
    operators: dict[str, OperatorProcess]  # by POD_NAME: "operator-a", "operator-b"
    ledger: Ledger
    namespace: str
    service: RoundRobinService

    def kubectl(self, *args, **kwargs):
        return self.rig.kubectl("-n", self.namespace, *args, **kwargs)

    def holder(self) -> str | None:
        """The POD_NAME of the replica the election Lease names (identities are <pod>_<suffix>)."""
        out = self.kubectl("get", "lease", "retex-operator-leader", "-o", "json", check=False)
        if out.returncode != 0:
            return None
        identity = json.loads(out.stdout)["spec"].get("holderIdentity")
        return identity.rsplit("_", 1)[0] if identity else None

    def lease(self) -> dict:
        return json.loads(self.kubectl("get", "lease", "retex-operator-leader", "-o", "json").stdout)["spec"]

    def other(self, name: str) -> str:
        return next(n for n in self.operators if n != name)

    def jobs(self) -> list[dict]:
        return json.loads(self.kubectl("get", "jobs", "-o", "json").stdout)["items"]


def rounds(operator: OperatorProcess) -> dict[str, float]:
    """Completed rounds of each writer loop of this replica (0 when it never ran one)."""
    seen = operator.metrics()
    return {loop: seen.get(("retex_loop_rounds_total", (("loop", loop),)), 0.0) for loop in WRITER_LOOPS}


@pytest.fixture
def pair(rig, postgres, tmp_path, request):
    """Two replicas. Parametrized (indirect) with an environment, operator-a gets it and starts
    first, and operator-b starts once a leads: the leader is the armed one."""
    armed = getattr(request, "param", None)
    number = next(_numbers)
    database, namespace = f"retex_ha_{number}", f"ha-{number}"
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    dsn = postgres.dsn(dbname=database)
    install_crd(rig.kubectl)
    prepare_namespace(rig.kubectl, namespace)
    names = ("operator-a", "operator-b")
    ledger_tls = pkilib.ledger_serving(Path(tmp_path) / "ledger-tls", rig.pod_host)  # one Secret, both replicas
    operators = {name: OperatorProcess.on(rig, dsn, Path(tmp_path) / f"{name}.log",
                                          extra_env={"RETEX_NAMESPACES": namespace, "POD_NAME": name},
                                          ledger_tls=ledger_tls)
                 for name in names}
    service = RoundRobinService([operators[name].ledger_port for name in names], host=rig.pod_host)
    if armed:
        operators["operator-a"].extra_env.update(armed)
    with Ledger(dsn) as ledger:
        started = Pair(rig=rig, operators=operators, ledger=ledger, namespace=namespace, service=service)
        try:
            for name in names:
                operators[name].extra_env["RETEX_LEDGER_URL"] = service.url
                operators[name].start()
                if armed and name == "operator-a":
                    wait_for(lambda: started.holder() == "operator-a", timeout=30, what="operator-a leads")
            yield started
        finally:
            for name, operator in operators.items():
                if operator.proc and operator.proc.poll() is None:
                    os.killpg(operator.proc.pid, signal.SIGCONT)  # a paused one cannot die otherwise
                operator.kill()
                print(f"--- {name} log tail ---\n{operator.log_tail()}")
            service.close()
            pods = json.loads(rig.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
            for pod in pods:
                name = pod["metadata"]["name"]
                print(f"--- pod {name} log tail ---\n{rig.pod_log(namespace, name)[-2000:]}")
            discard_namespace(rig.kubectl, namespace)


def submit(pair: Pair, stub, names: list[str], sleep: float) -> None:
    """Each task: a step that runs a while (so a failover happens under it), then one effect at
    the stub that executes every delivery (a second run would count twice)."""
    for name in names:
        steps = [{"name": "work", "exec": {"command": ["sh", "-c", f"sleep {sleep}; echo worked"]}},
                 {"name": "effect", "http": {"method": "POST", "url": f"{stub.url}/effects/notify"}}]
        pair.kubectl("apply", "-f", "-", input=task_manifest(name, steps))


def phase(pair: Pair, name: str) -> str | None:
    out = pair.kubectl("get", "task", name, "-o", "json", check=False)
    return (json.loads(out.stdout).get("status") or {}).get("phase") if out.returncode == 0 else None


def lease_holder(pair: Pair, name: str) -> str | None:
    out = pair.kubectl("get", "task", name, "-o", "json", check=False)
    return ((json.loads(out.stdout).get("status") or {}).get("lease") or {}).get("holder") if out.returncode == 0 else None


def assert_each_ended_once(pair: Pair, stub, names: list[str]) -> None:
    """Succeeded in the ledger and on the object, the effect executed once, every attempt epoch 1
    (no worker replaced), one Job per task."""
    for name in names:
        wait_for(lambda n=name: phase(pair, n) == "Succeeded", timeout=120, what=f"{name} Succeeded")
    jobs = pair.jobs()
    for name in names:
        record = pair.ledger.find(pair.namespace, name)
        assert record.epoch == 1, f"{name}: its worker was replaced (epoch {record.epoch})"
        commits = [h.step_idx for h in pair.ledger.history(record.uid) if h.event == "step-commit"]
        assert sorted(commits) == [0, 1], f"{name}: {commits}"
        counts = stub.for_task(record.uid)
        assert counts["notify"]["executions"] == 1, f"{name}: {counts}"
        owned = [j for j in jobs if j["metadata"]["labels"].get("retex.dev/task-uid") == record.uid]
        assert len(owned) == 1, f"{name}: {[j['metadata']['name'] for j in owned]}"


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat: T once a SIGSTOP has taken effect."""
    return stat_fields(pid)[0]


def wait_leader(pair: Pair, timeout: float = 30) -> str:
    return wait_for(pair.holder, timeout=timeout, what="an elected leader")


def test_two_replicas_elect_one_leader_and_only_it_writes(pair, stubs):
    _, notifier = stubs
    leader = wait_leader(pair)
    standby = pair.other(leader)
    names = [f"once-{i}" for i in range(4)]
    submit(pair, notifier, names, sleep=0.5)
    assert_each_ended_once(pair, notifier, names)
    assert pair.operators[leader].leader_gauge() == 1 and pair.operators[standby].leader_gauge() == 0
    assert pair.holder() == leader, "the leader changed although nothing failed"
    assert all(rounds(pair.operators[leader])[loop] > 0 for loop in WRITER_LOOPS)
    assert rounds(pair.operators[standby]) == dict.fromkeys(WRITER_LOOPS, 0.0), "the standby ran a writer loop"
    # Both are ready, so the Service sends workers' calls to either: a standby's idle loops are by design.
    assert [pair.operators[name].probe("/readyz") for name in (leader, standby)] == [(200, "ok\n")] * 2
    # A dashboard tells the replicas apart: every Event names the one that reported it.
    events = json.loads(pair.rig.kubectl("get", "events", "-n", pair.namespace, "-o", "json").stdout)["items"]
    reported = {e.get("reportingInstance") for e in events if e["involvedObject"]["kind"] == "Task"}
    assert reported == {leader}, reported


@pytest.mark.slow
def test_a_sigkilled_leader_is_replaced_within_lease_duration_plus_5s_and_no_live_worker_is_replaced(pair, stubs):
    _, notifier = stubs
    leader = wait_leader(pair)
    standby = pair.other(leader)
    names = [f"killed-{i}" for i in range(3)]
    submit(pair, notifier, names, sleep=8)
    wait_for(lambda: all(phase(pair, n) == "Running" for n in names), timeout=60, what="every task Running")
    killed = pair.operators[leader]
    killed.kill()
    killed_at = time.monotonic()
    assert killed.exited() == -signal.SIGKILL, "the fault did not fire: the leader did not die by SIGKILL"
    wait_for(lambda: pair.holder() == standby, timeout=LEASE_SECONDS + 5, what=f"{standby} leads")
    took_over = time.monotonic() - killed_at
    assert took_over <= LEASE_SECONDS + 5, f"takeover after {took_over:.1f}s"
    assert pair.operators[standby].leader_gauge() == 1
    assert_each_ended_once(pair, notifier, names)


@pytest.mark.slow
def test_a_paused_leader_stops_writing_at_its_renew_deadline_and_resumes_as_a_follower(pair, stubs):
    _, notifier = stubs
    old = wait_leader(pair)
    new = pair.other(old)
    paused = pair.operators[old]
    names = [f"paused-{i}" for i in range(3)]
    submit(pair, notifier, names, sleep=3)
    # Every worker holds its lease first: a worker whose first ledger call lands on the paused
    # replica (the rig's Service has no readiness) gives up before it holds one (docs/operator.md).
    wait_for(lambda: all(lease_holder(pair, n) for n in names), timeout=60, what="every worker holding its lease")
    os.killpg(paused.proc.pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    wait_for(lambda: process_state(paused.proc.pid) == "T", timeout=5, what="the leader stopped (SIGSTOP)")
    wait_for(lambda: pair.holder() == new, timeout=LEASE_SECONDS + 5, what=f"{new} leads")
    assert time.monotonic() - paused_at >= RENEW_DEADLINE, "taken over before the old leader's deadline"
    transitions = pair.lease()["leaseTransitions"]
    assert_each_ended_once(pair, notifier, names)  # under the new leader, the old one still paused
    os.killpg(paused.proc.pid, signal.SIGCONT)
    wait_for(lambda: paused.leader_gauge() == 0, timeout=10, what="the old leader reports itself a follower")
    before = rounds(paused)
    later = [f"after-{i}" for i in range(2)]
    submit(pair, notifier, later, sleep=0.5)
    assert_each_ended_once(pair, notifier, later)
    assert rounds(paused) == before, "the old leader ran a writer loop after it lost the lease"
    assert pair.holder() == new and pair.lease()["leaseTransitions"] == transitions, \
        "the old leader took the lease back"
    assert "stopped leading" in paused.log_path.read_text()


@pytest.mark.slow
def test_failover_after_sigkill_takes_the_lease_duration_plus_a_retry_measured_over_ten_kills(pair):
    """The failover time docs/operator.md reports: SIGKILL to the standby's holding the Lease (as
    polled through kubectl, ~0.2 s resolution), ten times, the killed replica restarting as the
    next standby."""
    took = []
    for _ in range(10):
        leader = wait_leader(pair)
        standby = pair.other(leader)
        wait_for(lambda s=standby: pair.operators[s].leader_gauge() == 0, timeout=30, what=f"{standby} standing by")
        killed = pair.operators[leader]
        killed.kill()
        killed_at = time.monotonic()
        assert killed.exited() == -signal.SIGKILL, "the fault did not fire"
        wait_for(lambda s=standby: pair.holder() == s, timeout=LEASE_SECONDS + 5, what=f"{standby} leads")
        took.append(time.monotonic() - killed_at)
        killed.start()
    took.sort()
    p50, p95 = statistics.median(took), took[math.ceil(0.95 * len(took)) - 1]
    print(f"failover after SIGKILL over {len(took)} runs (lease {LEASE_SECONDS:.0f} s): "
          f"p50 {p50:.1f} s, p95 {p95:.1f} s, all {[round(t, 1) for t in took]}")
    assert took[-1] <= LEASE_SECONDS + 5


def test_a_leader_stopped_with_sigterm_frees_the_lease_and_the_standby_takes_over_without_waiting_it_out(pair):
    leader = wait_leader(pair)
    standby = pair.other(leader)
    wait_for(lambda: pair.operators[standby].leader_gauge() == 0, timeout=30, what=f"{standby} standing by")
    stopped = pair.operators[leader]
    stopped.stop()  # SIGTERM, waits for the exit
    exited_at = time.monotonic()
    assert stopped.exited() == 0, f"the leader did not stop cleanly (exit {stopped.exited()})"
    wait_for(lambda: pair.holder() == standby, timeout=LEASE_SECONDS + 5, what=f"{standby} leads")
    took = time.monotonic() - exited_at
    assert took < LEASE_SECONDS, f"took {took:.1f}s: the lease was waited out, not freed"
    assert "released the lease" in stopped.log_path.read_text()


# The leader freezes (SIGSTOP) inside the relay's transaction as it is about to send `late`'s
# dispatch record: its claims are locked, nothing of the record is sent.
FROZEN_IN_BATCH = {"RETEX_FAILPOINT": "in-dispatch-batch@late=stop"}
# The operator's ledger sessions end a transaction idle this long (the renew deadline).
IDLE_IN_TRANSACTION = session_limits(ElectionTiming(
    LEASE_SECONDS, RENEW_DEADLINE, float(LEADER_ELECTION_FOR_TESTS["RETEX_LEADER_RETRY_SECONDS"]))).idle_in_transaction_seconds


def freeze_leader_in_its_transaction(pair: Pair, notifier, running: list[str]) -> OperatorProcess:
    """operator-a leads with FROZEN_IN_BATCH armed; tasks run; `late` is submitted and the leader
    freezes dispatching it. Returns the frozen replica, with the fault proved: stopped, its line
    printed, and `late`'s dispatch record locked by its open transaction. The rig's Service
    stand-in has no readiness probe: the frozen replica is taken out of it, as the endpoints
    controller would once its probe failed, so the workers that start now reach the successor."""
    frozen = pair.operators["operator-a"]
    assert pair.holder() == "operator-a"
    submit(pair, notifier, running, sleep=8)
    wait_for(lambda: all(lease_holder(pair, n) for n in running), timeout=60, what="every worker holding its lease")
    submit(pair, notifier, ["late"], sleep=0.5)
    wait_for(lambda: process_state(frozen.proc.pid) == "T", timeout=30, what="the leader frozen (SIGSTOP)")
    assert "retex failpoint in-dispatch-batch@late fired: task=late" in frozen.log_path.read_text()
    late = pair.ledger.find(pair.namespace, "late")
    assert late is not None and late.epoch == 1
    assert dispatch_locked(pair, late.uid), "the frozen leader's transaction holds no lock on late's record"
    pair.service.remove(frozen.ledger_port)
    return frozen


def wait_dispatched_by_the_successor(pair: Pair, uid: str) -> None:
    """`uid`'s Job created within D + 5 s + the idle-in-transaction timeout of the freeze; when
    not, the sessions and locks that held it up are in the failure."""
    try:
        wait_for(lambda: job_of(pair, uid), timeout=LEASE_SECONDS + 5 + IDLE_IN_TRANSACTION,
                 what="late dispatched by the successor")
    except Exception:
        with psycopg.connect(pair.ledger._dsn, autocommit=True) as conn:
            for row in conn.execute(
                    """SELECT a.pid, a.state, a.wait_event_type, a.wait_event, now() - a.state_change AS for,
                              left(a.query, 200), l.locktype, l.relation::regclass, l.mode, l.granted
                       FROM pg_stat_activity a LEFT JOIN pg_locks l ON l.pid = a.pid
                       WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()"""):
                print("session:", row)
        raise


def dispatch_locked(pair: Pair, uid: str) -> bool:
    with psycopg.connect(pair.ledger._dsn, autocommit=True) as conn:
        try:
            conn.execute("SELECT 1 FROM retex.outbox WHERE task_uid = %s FOR UPDATE NOWAIT", (uid,))
        except psycopg.errors.LockNotAvailable:
            return True
    return False


def job_of(pair: Pair, uid: str) -> str | None:
    return next((j["metadata"]["name"] for j in pair.jobs() if j["metadata"]["labels"].get("retex.dev/task-uid") == uid),
                None)


@pytest.mark.slow
@pytest.mark.parametrize("pair", [FROZEN_IN_BATCH], indirect=True)
def test_a_leader_lost_inside_a_ledger_transaction_does_not_block_its_successor_and_every_task_ends_once(pair, stubs):
    """Node loss as the rig can show it: the leader stops dead inside the relay's transaction and
    is never resumed. Its process keeps its sockets, so Postgres sees a session idle in a
    transaction that holds row locks and the API server a client that says nothing, as when a
    node hangs or is cut off without its connections being reset. Not covered: the node's pods
    (the rig's nodes stay up, the workers with them), TCP keepalives failing (the host still
    answers them), the node going NotReady. Before the ledger fence the successor skipped the
    locked record (SKIP LOCKED) for as long as the frozen session lived: `late` never ran."""
    _, notifier = stubs
    running = [f"running-{i}" for i in range(3)]
    freeze_leader_in_its_transaction(pair, notifier, running)
    late = pair.ledger.find(pair.namespace, "late")
    wait_dispatched_by_the_successor(pair, late.uid)
    assert pair.holder() == "operator-b"
    assert_each_ended_once(pair, notifier, [*running, "late"])


def ledger_marks(pair: Pair) -> tuple:
    """What any ledger write by the operator changes: history and the outbox."""
    with psycopg.connect(pair.ledger._dsn, autocommit=True) as conn:
        history = conn.execute("SELECT count(*), max(id) FROM retex.history").fetchone()
        outbox = conn.execute("SELECT count(*), max(sent_at), sum(attempts) FROM retex.outbox").fetchone()
    return history, outbox


def events_reported_by(pair: Pair, instance: str) -> int:
    events = json.loads(pair.kubectl("get", "events", "-o", "json").stdout)["items"]
    return sum(1 for e in events if e.get("reportingInstance") == instance)


@pytest.mark.slow
@pytest.mark.parametrize("pair", [FROZEN_IN_BATCH], indirect=True)
def test_a_leader_resumed_after_its_successor_started_writes_nothing_its_open_transaction_is_refused(pair, stubs):
    """The partition, as a pause inside a ledger write transaction: the old leader is frozen
    holding the relay's claims while the successor takes over and finishes every task; resumed,
    its transaction is refused and it writes nothing more, to the ledger or to the API server."""
    _, notifier = stubs
    running = [f"running-{i}" for i in range(3)]
    frozen = freeze_leader_in_its_transaction(pair, notifier, running)
    late = pair.ledger.find(pair.namespace, "late")
    wait_dispatched_by_the_successor(pair, late.uid)
    assert_each_ended_once(pair, notifier, [*running, "late"])
    marks, reported = ledger_marks(pair), events_reported_by(pair, "operator-a")
    log_before = len(frozen.log_path.read_bytes())
    os.killpg(frozen.proc.pid, signal.SIGCONT)
    wait_for(lambda: "round abandoned" in frozen.log_path.read_bytes()[log_before:].decode(errors="replace"),
             timeout=10, what="the old leader's relay round refused")
    wait_for(lambda: frozen.leader_gauge() == 0, timeout=10, what="the old leader reports itself a follower")
    time.sleep(3 * RENEW_DEADLINE)  # longer than every loop's period: what it would write, it has
    resumed = frozen.log_path.read_bytes()[log_before:].decode(errors="replace").splitlines()
    refused = [line for line in resumed if "round abandoned" in line]
    assert any('"loop": "relay"' in line for line in refused), refused
    assert not [line for line in resumed if "attempt dispatched" in line], "the old leader dispatched after resuming"
    assert ledger_marks(pair) == marks, "the ledger changed after the old leader resumed"
    assert events_reported_by(pair, "operator-a") == reported, "the old leader posted an Event after resuming"
    assert pair.holder() == "operator-b"
    assert len([j for j in pair.jobs() if j["metadata"]["labels"].get("retex.dev/task-uid") == late.uid]) == 1


# The leader freezes (SIGSTOP) in its promoter's first round: past `may_write`, before the
# round's first ledger write. The promoter calls no API server, so once resumed nothing but the
# ledger's term fence stands between it and that write.
FROZEN_BEFORE_A_LEDGER_WRITE = {"RETEX_FAILPOINT": "in-loop-round:promoter=stop"}
TERM_TAKEN = "ledger term taken: this replica writes as the leader"


def logged(operator: OperatorProcess, msg: str, *, since: int = 0) -> list[dict]:
    """The operator's JSON log lines with message `msg`, from byte `since` of its log on."""
    found = []
    for line in operator.log_path.read_bytes()[since:].decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # kopf's and the failpoint's plain lines
        if isinstance(entry, dict) and entry.get("msg") == msg:
            found.append(entry)
    return found


def ledger_term(pair: Pair) -> int:
    with psycopg.connect(pair.ledger._dsn, autocommit=True) as conn:
        return conn.execute("SELECT term FROM retex.leadership").fetchone()[0]


def due(pair: Pair, uid: str) -> bool:
    """Whether the task's notBefore has passed, on the database's clock (the promoter's)."""
    with psycopg.connect(pair.ledger._dsn, autocommit=True) as conn:
        return conn.execute("SELECT not_before <= now() FROM retex.tasks WHERE uid = %s", (uid,)).fetchone()[0]


@pytest.mark.slow
@pytest.mark.parametrize("pair", [FROZEN_BEFORE_A_LEDGER_WRITE], indirect=True)
def test_a_leader_resumed_between_its_leading_check_and_a_ledger_write_is_refused_by_the_term_fence(pair, stubs):
    """The old leader froze after its promoter's round was allowed to start and before that
    round's first ledger write; the successor takes the Lease and a newer term, runs tasks, and
    is itself paused (a GC pause, say) just before a scheduled task falls due. The old leader
    resumed then finds that task due and no successor's write ahead of it, and its round makes
    no call the KubeCalls gate could stop: only the ledger's term check refuses its write."""
    _, notifier = stubs
    old, new = pair.operators["operator-a"], pair.operators["operator-b"]
    wait_for(lambda: process_state(old.proc.pid) == "T", timeout=30, what="the leader frozen (SIGSTOP)")
    assert "retex failpoint in-loop-round:promoter fired: task=- uid=- step=promoter: SIGSTOP" in old.log_path.read_text()
    pair.service.remove(old.ledger_port)  # its readiness would fail: workers reach the successor
    [taken] = logged(old, TERM_TAKEN)
    wait_for(lambda: pair.holder() == "operator-b", timeout=LEASE_SECONDS + 5, what="operator-b leads")
    wait_for(lambda: logged(new, TERM_TAKEN), timeout=30, what="operator-b took the ledger's term")
    term = ledger_term(pair)
    assert term > taken["term"], f"the successor's term {term} is not newer than the old leader's {taken['term']}"

    early = [f"early-{i}" for i in range(2)]
    submit(pair, notifier, early, sleep=0.5)
    assert_each_ended_once(pair, notifier, early)
    not_before = math.ceil(time.time()) + 8  # whole seconds, as notBefore is written
    pair.kubectl("apply", "-f", "-", input=task_manifest(
        "scheduled", [{"name": "work", "exec": {"command": ["sh", "-c", "echo worked"]}},
                      {"name": "effect", "http": {"method": "POST", "url": f"{notifier.url}/effects/notify"}}],
        notBefore=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(not_before))))
    wait_for(lambda: (r := pair.ledger.find(pair.namespace, "scheduled")) is not None and r.phase == "Scheduled",
             timeout=30, what="scheduled admitted, not yet due")
    scheduled = pair.ledger.find(pair.namespace, "scheduled")
    assert not due(pair, scheduled.uid), "admitted too late: already due"
    reported = events_reported_by(pair, "operator-a")
    time.sleep(max(0.0, not_before - 0.7 - time.time()))

    # The successor paused for about a second (under its renew deadline): it keeps the Lease and
    # the term, and promotes nothing meanwhile.
    os.killpg(new.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: process_state(new.proc.pid) == "T", timeout=5, interval=0.05, what="the successor paused")
        marks = ledger_marks(pair)
        wait_for(lambda: due(pair, scheduled.uid), timeout=5, interval=0.05, what="scheduled due")
        log_before = len(old.log_path.read_bytes())
        os.killpg(old.proc.pid, signal.SIGCONT)
        wait_for(lambda: logged(old, "not the leader: round abandoned", since=log_before) or rounds(old)["promoter"],
                 timeout=5, interval=0.05, what="the old leader's promoter round over")
        written = ledger_marks(pair)
    finally:
        os.killpg(new.proc.pid, signal.SIGCONT)
    assert written == marks, "the old leader's promoter wrote to the ledger after its successor took the term"
    refused = [e for e in logged(old, "not the leader: round abandoned", since=log_before) if e.get("loop") == "promoter"]
    assert refused and refused[0]["why"].endswith(f"the ledger's leadership term is {term}, this writer's is {taken['term']}"), \
        refused

    wait_for(lambda: old.leader_gauge() == 0, timeout=10, what="the old leader reports itself a follower")
    assert_each_ended_once(pair, notifier, [*early, "scheduled"])
    assert pair.holder() == "operator-b"
    assert ledger_term(pair) == term, "the leadership term changed: the successor was deposed"
    resumed = old.log_path.read_bytes()[log_before:].decode(errors="replace")
    assert "attempt dispatched" not in resumed, "the old leader dispatched after resuming"
    assert events_reported_by(pair, "operator-a") == reported, "the old leader posted an Event after resuming"


def through(slow: SlowAnswers, kubeconfig: Path, to: Path) -> Path:
    """A copy of `kubeconfig` whose clusters are reached through `slow` (same host name: TLS still checks)."""
    config = yaml.safe_load(kubeconfig.read_text())
    for cluster in config["clusters"]:
        server = urllib.parse.urlsplit(cluster["cluster"]["server"])
        cluster["cluster"]["server"] = server._replace(netloc=f"{server.hostname}:{slow.server_address[1]}").geturl()
    to.write_text(yaml.safe_dump(config))
    return to


def api_port(kubeconfig: Path) -> int:
    config = yaml.safe_load(kubeconfig.read_text())
    ports = {urllib.parse.urlsplit(c["cluster"]["server"]).port for c in config["clusters"]}
    assert len(ports) == 1, ports
    return ports.pop()


def test_a_leader_whose_api_server_answers_slower_than_its_retry_period_keeps_leading(retex, tmp_path):
    """The scale benchmark on kind (docs/benchmarks.md): a loaded API server answered the
    election's calls in more than the 0.5 s they were each given (the tests' retry period), and
    the operator lost its own leadership 17 times. Here every answer of the API server reaches
    the operator 0.7 s late, for five renew deadlines: it keeps leading, and its renewals land."""
    operator = retex.operator
    slow = SlowAnswers(api_port(operator.kubeconfig))
    try:
        slow_config = through(slow, operator.kubeconfig, tmp_path / "slow-kubeconfig")
        operator.kill()
        operator.kubeconfig = slow_config
        operator.start()
        wait_for(lambda: operator.leader_gauge() == 1, timeout=30, what="the operator leads")
        since = operator.log_path.stat().st_size
        lease = json.loads(retex.kubectl("get", "lease", "retex-operator-leader", "-o", "json").stdout)["spec"]

        slow.delay = RETRY_PERIOD + 0.2
        began = time.monotonic()
        run_kubectl(slow_config, "-n", retex.namespace, "get", "lease", "retex-operator-leader")
        took = time.monotonic() - began
        assert took >= slow.delay, f"the fault did not fire: a call through the slow link took {took:.2f}s"
        gauge = []
        while time.monotonic() - began < 5 * RENEW_DEADLINE:
            gauge.append(operator.leader_gauge())
            time.sleep(0.5)
        after = json.loads(retex.kubectl("get", "lease", "retex-operator-leader", "-o", "json").stdout)["spec"]
    finally:
        slow.delay = 0.0
        slow.close()
    lost = logged(operator, "leader election: this replica stopped leading", since=since)
    assert lost == [] and set(gauge) == {1.0}, f"lost its leadership over a slow API server: {lost}, gauge {gauge}"
    assert after["holderIdentity"] == lease["holderIdentity"] and after["leaseTransitions"] == lease["leaseTransitions"]
    assert after["renewTime"] != lease["renewTime"], "no renewal landed through the slow link"
    assert logged(operator, "leader election: call failed", since=since) == [], "a renewal was given up"
