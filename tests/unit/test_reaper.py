"""The reaper's decisions, driven with small fakes of the ledger and the API calls (the lease
observer is the real one): a verdict from the watch is confirmed with a GET before an attempt is
replaced, one failing API call costs only its own attempt, a pod that is only slow is not failed,
and a worker that claimed its attempt meanwhile keeps its Job."""

import time
from types import SimpleNamespace

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from retex.kube.leasewatch import LeaseObserver
from retex.kube.objects import lease_name
from retex.kube.operator_calls import NotLeading
from retex.kube.podwatch import PodEndings
from retex.ledger import NotLeader, WatchedAttempt
from retex.operator.reaper import JOB_CHECK_SECONDS as JOB_CHECK
from retex.operator.reaper import LATE_RENEWAL_FRACTION as LATE_FRACTION
from retex.operator.reaper import POD_LOOKS_PER_ROUND as REAPER_POD_LOOKS
from retex.operator.reaper import Reaper

DURATION = 15


class Clock:
    """The observer's clock: time.monotonic (the reaper's) shifted by `ago`."""

    def __init__(self):
        self.ago = 0.0

    def __call__(self):
        return time.monotonic() - self.ago


def name_of(uid):
    return lease_name(f"t-{uid}", uid)


def lease(uid, renew, holder):
    return {"metadata": {"name": name_of(uid), "namespace": "ns", "labels": {"retex.dev/task-uid": uid}},
            "spec": {"holderIdentity": holder, "renewTime": renew, "leaseDurationSeconds": DURATION}}


def attempt(uid, *, epoch=1, current=True, job="job-1", dispatched=1.0, cancel=False):
    return WatchedAttempt(uid=uid, namespace="ns", name=f"t-{uid}", epoch=epoch, current=current,
                          cancel_requested=cancel, job_name=job, dispatched_seconds_ago=dispatched)


class FakeLedger:
    """`ended_by_worker`: uid → the outcome its worker gave the attempt before any replacement
    (the ledger then refuses to replace it); otherwise `replace_attempt` ends it as lost."""

    def __init__(self, watched, *, claimed=(), ended_by_worker=None):
        self._watched, self._claimed = watched, set(claimed)
        self._outcomes = dict(ended_by_worker or {})
        self.calls = []

    def watched(self):
        return self._watched

    def replace_attempt(self, uid, epoch, *, cause):
        self.calls.append(("replace_attempt", uid, epoch, cause))
        self._outcomes.setdefault(uid, "lost")

    def attempts(self, uid):
        return [SimpleNamespace(epoch=1, outcome=self._outcomes.get(uid))]

    def fail_unstarted(self, uid, epoch, error):
        self.calls.append(("fail_unstarted", uid, epoch))
        phase = "Running" if uid in self._claimed else "Retrying"
        return SimpleNamespace(uid=uid, epoch=epoch, phase=phase)

    def cancel_unheld(self, uid, epoch):
        self.calls.append(("cancel_unheld", uid, epoch))

    def settle_attempt(self, uid, epoch):
        self.calls.append(("settle_attempt", uid, epoch))


class FakeKube:
    """`job`: what every Job GET answers (one with a pod still active, by default); `delete_refused`:
    the API error every Job delete raises."""

    def __init__(self, *, leases=None, pods=(), failing=(), job=None, delete_refused=None):
        self.leases, self.pods, self.failing = leases or {}, list(pods), set(failing)
        self.job = job if job is not None else {"status": {"active": 1}}
        self.delete_refused = delete_refused
        self.nodes_forbidden = False
        self.deleted = []

    def get_lease(self, namespace, name):
        if name in self.failing:
            raise ApiException(status=500, reason="etcdserver: request timed out")
        return self.leases.get(name)

    def get_job(self, namespace, name):
        return self.job

    def job_pods(self, namespace, job):
        return self.pods

    def job_events(self, namespace, job):
        return []

    def node_labelled(self, selector):
        if self.nodes_forbidden:
            raise ApiException(status=403, reason="Forbidden")
        return False

    def delete_job(self, namespace, name):
        if self.delete_refused is not None:
            raise self.delete_refused
        self.deleted.append(name)


def reaper(ledger, kube, watched_leases, clock=None, pods=None):
    """`pods`: what the pod watch has seen (none by default: every verdict as if it were blind)."""
    observer = LeaseObserver(client.ApiClient(), clock=clock or Clock())
    observer.relisted(watched_leases)
    observer.synced.set()
    return Reaper(ledger, kube, observer, pods or PodEndings(client.ApiClient()), interval=1.0,
                  start_deadline_seconds=120)


R1, R2 = "2026-12-03T09:00:01.000000Z", "2026-12-03T09:00:31.000000Z"


def stale_watch(*uids):
    """The watch last saw each uid's lease held by epoch 1 long ago (a stalled stream, a paused
    operator): by the watch alone, every one of them is expired."""
    clock = Clock()
    clock.ago = DURATION * 3
    return clock, [lease(uid, R1, "pod-a:1") for uid in uids]


def test_a_lease_the_stale_watch_shows_expired_is_not_replaced_when_the_get_shows_a_renewal():
    clock, seen = stale_watch("u1")
    ledger = FakeLedger([attempt("u1")])
    kube = FakeKube(leases={name_of("u1"): lease("u1", R2, "pod-a:1")})  # renewed all along
    r = reaper(ledger, kube, seen, clock)
    clock.ago = 0.0
    r.round()
    assert ledger.calls == []
    assert kube.deleted == []


def test_a_lease_the_get_confirms_as_expired_is_replaced_and_its_job_deleted():
    clock, seen = stale_watch("u1")
    ledger = FakeLedger([attempt("u1")])
    kube = FakeKube(leases={name_of("u1"): lease("u1", R1, "pod-a:1")})  # no renewal since
    r = reaper(ledger, kube, seen, clock)
    clock.ago = 0.0
    r.round()
    assert ledger.calls == [("replace_attempt", "u1", 1, "lease-expired")]
    assert kube.deleted == ["job-1"]


def test_one_failing_api_call_costs_only_its_own_attempt_and_the_round_goes_on():
    clock, seen = stale_watch("u1", "u2")
    ledger = FakeLedger([attempt("u1"), attempt("u2", job="job-2")])
    kube = FakeKube(leases={name_of("u2"): lease("u2", R1, "pod-a:1")}, failing={name_of("u1")})
    r = reaper(ledger, kube, seen, clock)
    clock.ago = 0.0
    r.round()
    assert ledger.calls == [("replace_attempt", "u2", 1, "lease-expired")]
    assert kube.deleted == ["job-2"]


@pytest.mark.parametrize("refused_by", ["kube-write", "ledger-term"])
def test_a_refusal_for_not_leading_ends_the_round_rather_than_moving_on_to_the_next_attempt(refused_by):
    clock, seen = stale_watch("u1", "u2")
    ledger = FakeLedger([attempt("u1"), attempt("u2", job="job-2")])
    kube = FakeKube(leases={name_of(u): lease(u, R1, "pod-a:1") for u in ("u1", "u2")})
    refusal = NotLeading("delete Job ns/job-1") if refused_by == "kube-write" else NotLeader("the term is 2")

    def refused(*args, **kwargs):
        raise refusal

    if refused_by == "kube-write":
        kube.delete_job = refused
    else:
        ledger.replace_attempt = refused
    r = reaper(ledger, kube, seen, clock)
    clock.ago = 0.0
    with pytest.raises(type(refusal)):
        r.round()
    assert [call[1] for call in ledger.calls] == (["u1"] if refused_by == "kube-write" else []), "u2 was judged"


STUCK = {"metadata": {"name": "job-1-x"}, "status": {"phase": "Pending", "containerStatuses": [
    {"name": "worker", "state": {"waiting": {"reason": "CreateContainerConfigError", "message": "no secret"}}}]}}
SLOW = {"metadata": {"name": "job-1-x"}, "status": {"phase": "Pending", "conditions": [
    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
     "message": "0/1 nodes are available: 1 Insufficient cpu."}]}}


def test_a_stuck_pod_past_the_start_deadline_fails_its_attempt_and_loses_its_job():
    ledger = FakeLedger([attempt("u1", dispatched=121.0)])
    kube = FakeKube(pods=[STUCK])
    reaper(ledger, kube, []).round()
    assert ledger.calls == [("fail_unstarted", "u1", 1)]
    assert kube.deleted == ["job-1"]


def test_a_pod_only_slow_past_the_start_deadline_is_left_waiting():
    ledger = FakeLedger([attempt("u1", dispatched=121.0)])
    kube = FakeKube(pods=[SLOW])
    reaper(ledger, kube, []).round()
    assert ledger.calls == []
    assert kube.deleted == []


def test_a_worker_that_claimed_its_attempt_after_the_lease_read_keeps_its_job():
    ledger = FakeLedger([attempt("u1", dispatched=121.0)], claimed={"u1"})
    kube = FakeKube(pods=[STUCK])
    reaper(ledger, kube, []).round()
    assert ledger.calls == [("fail_unstarted", "u1", 1)]  # the ledger refused: its worker claimed it
    assert kube.deleted == []


def test_a_blind_reaper_judges_nobody():
    clock, seen = stale_watch("u1")
    ledger = FakeLedger([attempt("u1")])
    r = reaper(ledger, FakeKube(), seen, clock)
    r._leases.went_blind()
    clock.ago = 0.0
    r.round()
    assert ledger.calls == []


def holder_pod(phase, state):
    return {"metadata": {"name": "pod-a"}, "status": {"phase": phase, "containerStatuses": [
        {"name": "worker", "state": state}]}}


KILLED = holder_pod("Failed", {"terminated": {"exitCode": 137, "reason": "Error"}})
RUNNING = holder_pod("Running", {"running": {"startedAt": "2026-12-03T09:00:00Z"}})
# What PodGC writes for a pod of a deleted Node: the phase, not what its kubelet reported.
MARKED_FAILED = holder_pod("Failed", {"running": {"startedAt": "2026-12-03T09:00:00Z"}})


# A renewal missed a moment ago: the reaper's first seconds of looking at the holder's pod.
JUST_LATE = DURATION * LATE_FRACTION + 0.1


def late_renewal(uid, pods):
    """The watch last saw a renewal 40% of the lease duration ago (a worker renews every fifth of
    its renew deadline or sooner), and the GET shows none since: the lease is held, not expired."""
    clock = Clock()
    clock.ago = DURATION * 0.4
    kube = FakeKube(leases={name_of(uid): lease(uid, R1, "pod-a:1")}, pods=pods)
    return clock, kube


def test_a_holder_whose_pod_has_terminated_is_replaced_before_its_lease_expires():
    clock, kube = late_renewal("u1", [KILLED])
    ledger = FakeLedger([attempt("u1")])
    r = reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock)
    clock.ago = 0.0
    r.round()
    assert ledger.calls == [("replace_attempt", "u1", 1, "disruption")]
    assert kube.deleted == ["job-1"]


@pytest.mark.parametrize("pod", [RUNNING, MARKED_FAILED], ids=["running", "marked-failed-by-the-control-plane"])
def test_a_late_renewal_is_no_verdict_while_the_holders_containers_are_not_reported_terminated(pod):
    clock, kube = late_renewal("u1", [pod])
    ledger = FakeLedger([attempt("u1")])
    r = reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock)
    clock.ago = 0.0
    r.round()
    assert ledger.calls == []
    assert kube.deleted == []


def controlled_by(job):
    return [{"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": f"uid-of-{job}", "controller": True}]


def watched(*pods):
    """A pod watch that has seen `pods` (each of Job job-1, in namespace ns)."""
    seen = PodEndings(client.ApiClient())
    seen.listed([{**pod, "metadata": {**pod["metadata"], "namespace": "ns", "ownerReferences": controlled_by("job-1")}}
                 for pod in pods])
    return seen


def test_a_holder_whose_pod_the_watch_saw_end_is_replaced_before_any_renewal_is_late():
    """Recovery from an observed death: the pod watch saw the holder's pod end, so the reaper
    waits for no late renewal and lists no pods; the Lease GET still confirms it."""
    clock, kube = late_renewal("u1", [])
    clock.ago = 0.0  # renewed just now
    listed = []
    kube.job_pods = lambda namespace, job: listed.append(job) or []
    ledger = FakeLedger([attempt("u1")])
    reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock, pods=watched(KILLED)).round()
    assert ledger.calls == [("replace_attempt", "u1", 1, "disruption")]
    assert listed == [] and kube.deleted == ["job-1"]


def test_a_holder_pod_the_watch_sees_end_wakes_the_reaper_for_a_round_now():
    """The watch's word is acted on at once, not at the reaper's next round (up to its interval)."""
    pods = watched()
    r = reaper(FakeLedger([]), FakeKube(), [], pods=pods)
    assert not r.wake.is_set()
    pods.changed("MODIFIED", {**KILLED, "metadata": {**KILLED["metadata"], "namespace": "ns",
                                                      "ownerReferences": controlled_by("job-1")}})
    assert r.wake.is_set()


@pytest.mark.parametrize("pod, job", [(KILLED, "job-0"), (RUNNING, "job-1"), (MARKED_FAILED, "job-1")],
                         ids=["another-jobs-pod", "running", "marked-failed-by-the-control-plane"])
def test_a_pod_the_watch_did_not_see_end_as_the_holders_is_no_verdict_before_a_late_renewal(pod, job):
    clock, kube = late_renewal("u1", [])
    clock.ago = 0.0
    ledger = FakeLedger([attempt("u1")])
    seen = watched(pod)
    seen.changed("MODIFIED", {**pod, "metadata": {"name": "pod-a", "namespace": "ns", "ownerReferences": controlled_by(job)}})
    reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock, pods=seen).round()
    assert ledger.calls == []


def test_a_holder_whose_ended_pod_the_get_shows_renewed_since_is_no_verdict():
    clock, kube = late_renewal("u1", [])
    clock.ago = 0.0
    kube.leases[name_of("u1")] = lease("u1", R2, "pod-a:1")  # a renewal the watch has not delivered
    ledger = FakeLedger([attempt("u1")])
    reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock, pods=watched(KILLED)).round()
    assert ledger.calls == []


def test_a_lease_renewed_on_time_costs_no_pod_list():
    clock, kube = late_renewal("u1", [KILLED])
    clock.ago = 0.0  # renewed just now
    listed = []
    kube.job_pods = lambda namespace, job: listed.append(job) or [KILLED]
    ledger = FakeLedger([attempt("u1")])
    reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock).round()
    assert (listed, ledger.calls) == ([], [])


def test_a_late_holder_whose_pod_was_not_yet_reported_terminated_is_looked_at_again_the_next_round(monkeypatch):
    """A kubelet reports a killed container a second or two after the kill, so the first look can
    come too early: the next is the next round's, not JOB_CHECK_SECONDS later (recovery from an
    observed death, docs/benchmarks.md)."""
    clock, kube = late_renewal("u1", [RUNNING])
    clock.ago = JUST_LATE
    ledger = FakeLedger([attempt("u1")])
    r = reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock)
    clock.ago = 0.0
    r.round()
    assert ledger.calls == []
    kube.pods = [KILLED]
    a_round_later = time.monotonic() + 1.1
    monkeypatch.setattr(time, "monotonic", lambda: a_round_later)
    r.round()
    assert ledger.calls == [("replace_attempt", "u1", 1, "disruption")]


def test_a_holder_late_for_longer_is_looked_at_every_few_seconds_only(monkeypatch):
    """A frozen worker holds its lease unrenewed until it expires, and an API brownout makes every
    renewal late: past the first seconds of lateness a pod LIST a round would only load the API."""
    clock, kube = late_renewal("u1", [RUNNING])
    clock.ago = DURATION * LATE_FRACTION + JOB_CHECK + 0.5
    listed = []
    kube.job_pods = lambda namespace, job: listed.append(job) or [RUNNING]
    r = reaper(FakeLedger([attempt("u1")]), kube, [lease("u1", R1, "pod-a:1")], clock)
    clock.ago = 0.0
    start = time.monotonic()
    for seconds_later in (0.0, 1.1, 2.2, JOB_CHECK + 0.1):
        monkeypatch.setattr(time, "monotonic", lambda s=seconds_later: start + s)
        r.round()
    assert len(listed) == 2, "looked at on the first round and again once JOB_CHECK_SECONDS had passed"


def test_a_terminated_pod_that_is_not_the_holder_is_no_verdict():
    """Two pods for one attempt (crash-matrix R10): the duplicate exited, the holder runs on."""
    duplicate = {**KILLED, "metadata": {"name": "pod-b"}}
    clock, kube = late_renewal("u1", [duplicate, RUNNING])
    ledger = FakeLedger([attempt("u1")])
    r = reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock)
    clock.ago = 0.0
    r.round()
    assert (ledger.calls, kube.deleted) == ([], [])


@pytest.mark.parametrize("now_shown", ["renewed since", "another pod of the attempt holds it"])
def test_a_dead_holder_is_no_verdict_when_the_lease_get_shows_a_change_since(now_shown):
    """The pod found terminated was the holder the watch showed; the GET shows a renewal the watch
    missed, or the attempt's other pod holding the lease now: that one may be inside a step."""
    clock, kube = late_renewal("u1", [KILLED])
    kube.leases[name_of("u1")] = lease("u1", R2, "pod-a:1") if now_shown == "renewed since" else \
        lease("u1", R1, "pod-b:1")
    ledger = FakeLedger([attempt("u1")])
    r = reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock)
    clock.ago = 0.0
    r.round()
    assert (ledger.calls, kube.deleted) == ([], [])


def test_a_round_looks_at_no_more_than_a_bounded_number_of_late_holders_pods():
    """An API brownout makes every renewal late: one pod LIST per running attempt in one round
    would stretch the round past the liveness probe's wedge floor. The rest wait for later rounds."""
    uids = [f"u{i}" for i in range(REAPER_POD_LOOKS + 5)]
    clock, kube = late_renewal(uids[0], [RUNNING])
    kube.leases = {name_of(u): lease(u, R1, "pod-a:1") for u in uids}
    listed = []
    kube.job_pods = lambda namespace, job: listed.append(job) or [RUNNING]
    ledger = FakeLedger([attempt(u, job=f"job-{u}") for u in uids])
    r = reaper(ledger, kube, [lease(u, R1, "pod-a:1") for u in uids], clock)
    clock.ago = 0.0
    r.round()
    assert len(listed) == REAPER_POD_LOOKS
    r.round()  # within JOB_CHECK_SECONDS: those looked at wait their turn
    assert sorted(listed) == sorted(f"job-{u}" for u in uids), "the next round looks at the ones left"


def test_late_holders_beyond_a_rounds_looks_take_turns_with_those_looked_at_before(monkeypatch):
    """Looked at again each round, the first attempts would take every look of every round in a
    brownout; the least recently looked at go first."""
    uids = [f"u{i}" for i in range(2 * REAPER_POD_LOOKS + 5)]
    clock, kube = late_renewal(uids[0], [RUNNING])
    kube.leases = {name_of(u): lease(u, R1, "pod-a:1") for u in uids}
    listed = []
    kube.job_pods = lambda namespace, job: listed.append(job) or [RUNNING]
    ledger = FakeLedger([attempt(u, job=f"job-{u}") for u in uids])
    clock.ago = JUST_LATE
    r = reaper(ledger, kube, [lease(u, R1, "pod-a:1") for u in uids], clock)
    clock.ago = 0.0
    start = time.monotonic()
    for round_number in range(3):
        monkeypatch.setattr(time, "monotonic", lambda n=round_number: start + 1.1 * n)
        r.round()
    assert len(listed) == 3 * REAPER_POD_LOOKS
    assert set(listed) == {f"job-{u}" for u in uids}, "every late holder was looked at within three rounds"


def test_an_attempt_its_worker_ended_before_the_replace_is_left_alone_with_its_job():
    """The watch showed it Running, its worker completed the task and exited, and the reaper saw a
    terminated pod: the ledger refuses the replacement (the task is no longer Running at that
    epoch), and the reaper must neither say it started the next attempt nor delete the finished
    Job, whose pod keeps the worker's log (the scale measure: 19 of 50 succeeded tasks lost theirs)."""
    clock, kube = late_renewal("u1", [KILLED])
    ledger = FakeLedger([attempt("u1")], ended_by_worker={"u1": "succeeded"})
    r = reaper(ledger, kube, [lease("u1", R1, "pod-a:1")], clock)
    clock.ago = 0.0
    r.round()
    assert ledger.calls == [("replace_attempt", "u1", 1, "disruption")]
    assert kube.deleted == []


def ended_and_dead(**kube):
    """An attempt the operator ended (a timeout, say), whose lease the watch and the GET both show
    expired: known dead."""
    clock, leases = stale_watch("u1")
    kube = FakeKube(leases={name_of("u1"): leases[0]}, **kube)
    ledger = FakeLedger([attempt("u1", current=False, job="job-1")])
    return ledger, kube, reaper(ledger, kube, leases, clock)


def test_an_ended_attempt_known_dead_is_settled_and_its_unfinished_job_deleted():
    """Its Job has not finished (a pod Pending for good, or a Job the relay was told may be left when
    it ended the attempt unsent): left, it would hold a pod of the quota until its
    activeDeadlineSeconds, or for ever without one."""
    ledger, kube, r = ended_and_dead()
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]
    assert kube.deleted == ["job-1"]


def test_an_ended_attempt_whose_job_finished_is_settled_and_the_job_left_to_its_ttl():
    """A finished Job goes by its ttlSecondsAfterFinished; until then its pod keeps the worker's log."""
    ledger, kube, r = ended_and_dead(job={"status": {"conditions": [{"type": "Failed", "status": "True"}], "failed": 1}})
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]
    assert kube.deleted == []


@pytest.mark.parametrize("condition", ["FailureTarget", "SuccessCriteriaMet"])
def test_an_ended_attempt_whose_job_is_ending_keeps_the_job_and_its_log(condition):
    """Kubernetes 1.31+ sets FailureTarget (SuccessCriteriaMet) the moment a Job's outcome is
    decided, and Failed (Complete) only once its pods are gone: in between the Job is ending by
    itself, and deleting it would take the worker's log with its pod."""
    ledger, kube, r = ended_and_dead(job={"status": {"conditions": [{"type": condition, "status": "True"}]}})
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]
    assert kube.deleted == []


def test_an_ended_attempt_whose_pod_ended_before_its_job_says_so_keeps_the_job_and_its_log():
    """The Job controller writes its condition a moment after the pod's end: a pod the kubelet
    reported terminated is as good as a finished Job."""
    ledger, kube, r = ended_and_dead(job={"status": {"active": 1}}, pods=[KILLED])
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]
    assert kube.deleted == []


def test_an_ended_attempt_whose_pod_is_only_marked_failed_loses_its_job():
    """PodGC's Failed for a pod of a deleted Node: its processes may still run; the Job goes."""
    ledger, kube, r = ended_and_dead(job={"status": {"active": 1}}, pods=[MARKED_FAILED])
    r.round()
    assert kube.deleted == ["job-1"]


def test_a_job_delete_refused_for_good_does_not_keep_a_dead_attempt_holding_its_slot():
    """A 403 (the namespace's RoleBinding removed) is the same every round: the attempt is settled
    all the same and the refusal logged."""
    ledger, kube, r = ended_and_dead(delete_refused=ApiException(status=403, reason="Forbidden"))
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]


def test_a_job_delete_failing_for_now_leaves_the_attempt_to_the_next_round():
    ledger, kube, r = ended_and_dead(delete_refused=ApiException(status=503, reason="Service Unavailable"))
    r.round()
    assert ledger.calls == []
    kube.delete_refused = None
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]
    assert kube.deleted == ["job-1"]


def worker_pod(phase, state, *, lease_seconds=DURATION):
    """A worker pod as its Job makes it (its lease duration in its env), being deleted."""
    pod = holder_pod(phase, state)
    env = [{"name": "RETEX_LEASE_DURATION_SECONDS", "value": str(lease_seconds)}] if lease_seconds else []
    pod["metadata"]["deletionTimestamp"] = "2026-12-03T09:01:00Z"
    pod["spec"] = {"restartPolicy": "Never", "containers": [{"name": "worker", "env": env}]}
    return pod


# Deleted with its Task, on a node that is gone: no kubelet reports its end, so it stays
# Terminating, Running, for as long as the node is away.
STUCK_TERMINATING = worker_pod("Running", {"running": {"startedAt": "2026-12-03T09:00:00Z"}})


def lease_gone(pods):
    """An attempt the operator ended (a timeout), whose Task was deleted since: its Lease went with
    the Task (neither the watch nor the GET shows one)."""
    ledger = FakeLedger([attempt("u1", current=False, job="job-1")])
    kube = FakeKube(pods=pods)
    return ledger, kube, reaper(ledger, kube, [])


def rounds_at(monkeypatch, r, *seconds_later):
    start = time.monotonic()
    for later in seconds_later:
        monkeypatch.setattr(time, "monotonic", lambda s=later: start + s)
        r.round()


def test_an_ended_attempt_without_a_lease_whose_pods_ended_is_settled_at_once():
    ledger, _, r = lease_gone([KILLED])
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]


def test_an_ended_attempt_without_a_lease_is_settled_a_lease_duration_after_the_lease_was_found_gone(monkeypatch):
    """Its pod stuck Terminating on a lost node held the slot and the concurrency key for as long
    as the node was away. No worker of the attempt can show a lease held since the Lease went (a
    renewal finds none): it gave its step up by its renew deadline and killed it within a second,
    before a lease duration was out."""
    ledger, _, r = lease_gone([STUCK_TERMINATING])
    rounds_at(monkeypatch, r, 0.0, DURATION - 0.5)
    assert ledger.calls == [], "settled before a lease duration since the Lease was found gone"
    rounds_at(monkeypatch, r, DURATION + 0.1)
    assert ledger.calls == [("settle_attempt", "u1", 1)]


def test_a_pod_only_marked_failed_keeps_an_attempt_without_a_lease_unsettled_for_a_lease_duration(monkeypatch):
    """PodGC marks the pods of a deleted Node Failed while their processes may still run: the
    phase is no word from a kubelet that the worker ended."""
    ledger, _, r = lease_gone([worker_pod("Failed", {"running": {"startedAt": "2026-12-03T09:00:00Z"}})])
    rounds_at(monkeypatch, r, 0.0)
    assert ledger.calls == []
    rounds_at(monkeypatch, r, DURATION + 0.1)
    assert ledger.calls == [("settle_attempt", "u1", 1)]


def test_a_pod_that_names_no_lease_duration_is_waited_for_until_its_end_is_reported(monkeypatch):
    """Not a worker as its Job makes it: how long it may run without its Lease is unknown."""
    ledger, kube, r = lease_gone([worker_pod("Running", {"running": {}}, lease_seconds=None)])
    rounds_at(monkeypatch, r, 0.0, 100 * DURATION)
    assert ledger.calls == []
    kube.pods = [KILLED]
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]


def test_the_wait_without_a_lease_starts_again_when_the_lease_was_seen_meanwhile(monkeypatch):
    ledger, kube, r = lease_gone([STUCK_TERMINATING])
    start = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: start)
    r.round()  # no Lease: the wait begins
    kube.leases[name_of("u1")] = lease("u1", R2, "pod-a:1")  # there again, held by the attempt
    monkeypatch.setattr(time, "monotonic", lambda: start + 1.0)
    r.round()
    del kube.leases[name_of("u1")]
    r._leases.confirm("ns", name_of("u1"), "u1", None)  # the watch saw it go
    monkeypatch.setattr(time, "monotonic", lambda: start + DURATION + 0.5)
    r.round()
    assert ledger.calls == [], "the time before the Lease was seen again counted"
    monkeypatch.setattr(time, "monotonic", lambda: start + 2 * DURATION + 1.0)
    r.round()
    assert ledger.calls == [("settle_attempt", "u1", 1)]


UNLABELLED = ("0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 node(s) didn't match Pod's node "
              "affinity/selector.")


def unscheduled_pod():
    return {"metadata": {"name": "job-1-x"}, "spec": {"nodeSelector": {"disk": "nvme"}},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNLABELLED}]}}


def test_a_selector_no_node_carries_fails_the_attempt_past_the_start_deadline():
    ledger = FakeLedger([attempt("u1", dispatched=500.0)])
    r = reaper(ledger, FakeKube(pods=[unscheduled_pod()]), [])
    r.round()
    assert ledger.calls == [("fail_unstarted", "u1", 1)]


def test_nodes_the_operator_may_not_list_leave_the_verdict_to_the_schedulers_message(caplog):
    """A ClusterRole from before the nodes rule (an upgrade that kept it): a 403 on the LIST must not
    fail the judging every round; the message alone then says slow here."""
    ledger = FakeLedger([attempt("u1", dispatched=500.0)])
    kube = FakeKube(pods=[unscheduled_pod()])
    kube.nodes_forbidden = True
    r = reaper(ledger, kube, [])
    with caplog.at_level("INFO", logger="retex.operator.reaper"):
        r.round()
    said = [record.getMessage() for record in caplog.records]
    assert ledger.calls == []
    assert not any("judging an attempt failed" in line for line in said), said
    assert any("only slow" in line for line in said), said
