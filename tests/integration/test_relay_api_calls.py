"""The outbox relay on a real ledger, with its API calls made by a fake that is slow, blocks or
dies: the relay makes them outside any ledger transaction, so a slow API server neither gets its
transactions ended by the session's idle-in-transaction limit (every record still settles) nor
keeps the placement lock (an admission in another session does not wait for the relay's call).
Its claims keep other relays off its records: a relay that died after creating a Job leaves the
record to the next once the claim lapses, and a deposed leader's relay settles nothing."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest

from retex.kube.objects import WorkerDefaults, job_name
from retex.ledger import Ledger, LedgerError, NotLeader
from retex.ledger.transactions import SessionLimits
from retex.operator.admission import admission_for
from retex.operator.dispatch import Relay

# The operator's sessions, with a short renew deadline: a transaction idle this long is ended.
LIMITS = SessionLimits(idle_in_transaction_seconds=1.0, lock_timeout_seconds=1.0)
CALL_SECONDS = 1.5  # each API call outlasts the idle limit; a record's three, several times over
SPEC = {"steps": [{"name": "only", "exec": {"command": ["true"]}}]}
DEFAULTS = WorkerDefaults(image="retex-worker:test", service_account="retex-worker", ledger_url="http://ledger")


class SlowKube:
    """The relay's API calls against Tasks that exist, each taking `seconds`; `hold` (a task
    name → Event) blocks that Task's GET until the event is set, and `calling` is set meanwhile.
    A Job's create is idempotent, as the deterministic name makes it."""

    def __init__(self, tasks: dict[str, str], *, seconds: float = 0.0, hold: dict[str, threading.Event] | None = None,
                 jobs: set[str] | None = None):
        self.tasks, self.seconds, self.hold = tasks, seconds, hold or {}
        self.calling = threading.Event()
        self.jobs: set[str] = set() if jobs is None else jobs

    def _call(self) -> None:
        time.sleep(self.seconds)

    def get_task(self, namespace, name):
        self._call()
        if name in self.hold:
            self.calling.set()
            assert self.hold[name].wait(30), "the test never released the held call"
        uid = self.tasks.get(name)
        return None if uid is None else {"metadata": {"uid": uid, "name": name, "namespace": namespace}, "spec": SPEC}

    def create_lease(self, body):
        self._call()

    def create_job(self, body):
        self._call()
        self.jobs.add(body["metadata"]["name"])

    def delete_job_of(self, namespace, name, task_uid):
        self._call()
        found = name in self.jobs
        self.jobs.discard(name)
        return found


class Died(BaseException):
    """The relay's process died here (nothing of it runs on: not an error it could handle)."""


class DyingKube(SlowKube):
    """The first relay's calls: it dies right after its Job is created (crash-matrix R3)."""

    def create_job(self, body):
        super().create_job(body)
        raise Died


@pytest.fixture
def leader(dsn, ledger):
    """The operator's ledger (`ledger` migrated the database): fenced, with the operator's
    session limits, holding the leadership term."""
    with Ledger(dsn, retry_for_seconds=5, limits=LIMITS, leader_fenced=True) as fenced:
        fenced.take_term(lock_timeout_seconds=1.0)
        yield fenced


@pytest.fixture
def patient_leader(dsn, ledger):
    """As `leader`, with sessions that wait as long as a test holds a call: a lock kept across
    the call would still be held when the admission comes."""
    with Ledger(dsn, retry_for_seconds=5, leader_fenced=True) as fenced:
        fenced.take_term(lock_timeout_seconds=1.0)
        yield fenced


def admit(ledger: Ledger, name: str) -> str:
    uid = str(uuid.uuid4())
    ledger.admit(admission_for(uid=uid, namespace="shop", name=name, spec=SPEC))
    return uid


def relay(ledger: Ledger, kube: SlowKube, *, claim_seconds: float = 30.0) -> Relay:
    return Relay(ledger, kube, lambda: DEFAULTS, interval=1.0, claim_seconds=claim_seconds, defer_limit_seconds=600)


def outcomes(dsn: str) -> dict[str, str | None]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT task_uid::text, outcome FROM retex.outbox").fetchall())


def test_a_relay_whose_api_calls_outlast_the_idle_transaction_limit_sends_every_record(leader, ledger, dsn):
    uids = {name: admit(ledger, name) for name in ("first", "second")}
    kube = SlowKube(uids, seconds=CALL_SECONDS)
    slow = relay(leader, kube)
    deadline, failed = time.monotonic() + 30, []
    while None in outcomes(dsn).values() and time.monotonic() < deadline:
        try:
            slow.relay_once()
        except LedgerError as exc:
            failed.append(str(exc))
    assert outcomes(dsn) == {uid: "sent" for uid in uids.values()}, f"ledger errors of the relay: {failed[:3]}"
    assert failed == []
    assert kube.jobs == {job_name(name, uid, 1) for name, uid in uids.items()}
    assert {name: ledger.attempts(uid)[0].job_name for name, uid in uids.items()} == {
        name: job_name(name, uid, 1) for name, uid in uids.items()}


def test_an_admission_does_not_wait_for_the_relays_api_call(patient_leader, ledger, dsn):
    """The relay ends a cancelled task's record (its settlement fills slots, taking the placement
    lock), then is held inside the next record's API call: an admission in another session
    places its task meanwhile."""
    cancelled = admit(ledger, "cancelled")
    ledger.request_cancel(cancelled)
    held = threading.Event()
    kube = SlowKube({"cancelled": cancelled, "held": admit(ledger, "held")}, hold={"held": held})
    relaying = threading.Thread(target=relay(patient_leader, kube).relay_once)
    relaying.start()
    try:
        assert kube.calling.wait(10), "the relay never reached the held call"
        admitted: list[str] = []
        admitting = threading.Thread(target=lambda: admitted.append(admit(ledger, "newcomer")))
        admitting.start()
        admitting.join(timeout=3)
        assert admitted, "the admission waited for the relay's API call"
        assert ledger.get(admitted[0]).phase == "Running"
        assert outcomes(dsn)[cancelled] == "dropped"  # settled and committed before the held call
    finally:
        held.set()
        relaying.join(timeout=30)


@pytest.mark.parametrize("then", ["sent", "cancelled"])
def test_a_relay_that_died_after_creating_a_job_leaves_the_record_to_the_next_once_its_claim_lapses(
        leader, ledger, dsn, then):
    """Crash-matrix R3 on the ledger: the record stays unsent under the dead relay's claim; the next
    relay (a successor's, its own term) claims it once that lapses, and meets the Job: sent again
    (the Job's create is AlreadyExists, success), or, the task cancelled meanwhile, the Job is
    deleted and the attempt keeps its slot until its worker is known dead."""
    uid = admit(ledger, "crash")
    jobs: set[str] = set()
    with pytest.raises(Died):
        relay(leader, DyingKube({"crash": uid}, jobs=jobs), claim_seconds=1.0).relay_once()
    job = job_name("crash", uid, 1)
    assert jobs == {job} and outcomes(dsn) == {uid: None}
    if then == "cancelled":
        ledger.request_cancel(uid)
    with Ledger(dsn, retry_for_seconds=5, limits=LIMITS, leader_fenced=True) as successor:
        successor.take_term(lock_timeout_seconds=1.0)
        next_relay = relay(successor, SlowKube({"crash": uid}, jobs=jobs))
        assert next_relay.relay_once() == 0, "the dead relay's claim did not keep the record"
        time.sleep(1.2)
        assert next_relay.relay_once() == 1
    attempt = ledger.attempts(uid)[0]
    if then == "sent":
        assert outcomes(dsn) == {uid: "sent"} and jobs == {job}
        assert (attempt.job_name, attempt.outcome) == (job, None)
    else:
        assert outcomes(dsn) == {uid: "dropped"} and jobs == set()
        assert (ledger.get(uid).phase, attempt.job_name, attempt.outcome) == ("Cancelled", job, "cancelled")
        assert [w.epoch for w in ledger.watched() if w.uid == uid] == [1]  # unsettled: the reaper's


def test_a_deposed_leaders_relay_settles_nothing_and_the_successor_sends_the_record(leader, ledger, dsn):
    """Deposed while inside its API call: the relay's settlement is refused by the term, the
    record stays unsent, and the successor's relay sends it once the old claim lapses."""
    uid = admit(ledger, "late")
    held = threading.Event()
    jobs: set[str] = set()
    kube = SlowKube({"late": uid}, hold={"late": held}, jobs=jobs)
    refused: list[BaseException] = []

    def old_relay() -> None:
        try:
            relay(leader, kube, claim_seconds=1.0).relay_once()
        except NotLeader as exc:
            refused.append(exc)

    relaying = threading.Thread(target=old_relay)
    relaying.start()
    assert kube.calling.wait(10), "the relay never reached its call"
    with Ledger(dsn, retry_for_seconds=5, limits=LIMITS, leader_fenced=True) as successor:
        successor.take_term(lock_timeout_seconds=1.0)  # no transaction of the old leader's is open to wait for
        held.set()
        relaying.join(timeout=30)
        assert refused, "the deposed leader's relay settled its record"
        assert outcomes(dsn) == {uid: None} and ledger.attempts(uid)[0].job_name is None
        time.sleep(1.2)
        assert relay(successor, SlowKube({"late": uid}, jobs=jobs)).relay_once() == 1
    assert outcomes(dsn) == {uid: "sent"} and jobs == {job_name("late", uid, 1)}
