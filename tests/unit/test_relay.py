"""The outbox relay's decisions, driven with small fakes of the ledger's batch and the API calls:
each record is settled on its own (sent, dropped, rejected, deferred), a record that ends unsent
first deletes a Job a dead relay may have left, a ledger spec that differs from the live Task's
gets no Job, a transient error defers that record alone until the limit, an error repeating
cannot cure fails the task at once, and a record that is no longer the relay's claim when it
comes to settle it is left as it is."""

import itertools
import logging

import pytest
from kubernetes.client.exceptions import ApiException

from retex.api import TaskSpec
from retex.kube.errors import NamespaceTerminating, NotPermitted, Refused
from retex.kube.objects import LABEL_TASK_UID, WorkerDefaults, job_name
from retex.kube.operator_calls import NotLeading
from retex.ledger import Dispatch, LedgerUnavailable
from retex.operator.dispatch import Relay

SPEC = TaskSpec.model_validate({"steps": [{"name": "only", "exec": {"command": ["true"]}}]}).as_admitted()
DEFER_LIMIT = 300.0
CLAIM_SECONDS = 5.0
_ids = itertools.count(1)


def record(uid, *, spec=SPEC, deferred=None, cancel=None, epoch=1):
    return Dispatch(id=next(_ids), task_uid=uid, epoch=epoch, namespace="ns", name=f"t-{uid}",
                    spec=spec, deferred_seconds=deferred, cancel_reason=cancel)


def live(uid, *, spec=SPEC, **metadata):
    return {"metadata": {"uid": uid, "name": f"t-{uid}", "namespace": "ns", **metadata}, "spec": spec}


def job_of(uid, epoch=1):
    return job_name(f"t-{uid}", uid, epoch)


class FakeOutcomes:
    """What the relay settled, by task uid; the records of `lost` (task uids) are no longer the
    relay's claim: their settlements write nothing."""

    def __init__(self, claimed, lost=()):
        self.claimed, self.lost = claimed, set(lost)
        self.settled = {}

    def _settle(self, dispatch, outcome):
        if dispatch.task_uid in self.lost:
            return False
        self.settled[dispatch.task_uid] = outcome
        return True

    def sent(self, dispatch, job_name):
        return self._settle(dispatch, ("sent", job_name))

    def dropped(self, dispatch, *, reason, job_name=None):
        return self._settle(dispatch, ("dropped", reason, job_name))

    def rejected(self, dispatch, message, *, reason, job_name=None):
        return self._settle(dispatch, ("rejected", reason, message, job_name))

    def deferred(self, dispatch, error):
        return 1.0 if self._settle(dispatch, ("deferred", error)) else None


class FakeLedger:
    def __init__(self, batch, *, attempts_error=None, lost=()):
        self.batch, self.outcomes = batch, FakeOutcomes(len(batch), lost)
        self._attempts_error = attempts_error
        self.claims = []  # (limit, claim_seconds) of each claim

    def dispatch_batch(self, *, limit, claim_seconds):
        self.claims.append((limit, claim_seconds))
        return self.batch, self.outcomes

    def attempts(self, uid):
        if self._attempts_error:
            raise self._attempts_error
        return []


class FakeKube:
    """Tasks by name (a value that is an exception is raised by the GET); `refuse`: task uid →
    the exception its Job's create raises; `jobs`: the Jobs that exist."""

    def __init__(self, tasks, *, refuse=None, lease_error=None, jobs=(), delete_error=None):
        self.tasks, self.refuse = tasks, refuse or {}
        self.lease_error, self.delete_error = lease_error, delete_error
        self.jobs = set(jobs)

    def get_task(self, namespace, name):
        task = self.tasks.get(name)
        if isinstance(task, Exception):
            raise task
        return task

    def create_lease(self, body):
        if self.lease_error:
            raise self.lease_error

    def create_job(self, body):
        error = self.refuse.get(body["metadata"]["labels"][LABEL_TASK_UID])
        if error:
            raise error
        self.jobs.add(body["metadata"]["name"])

    def delete_job_of(self, namespace, name, task_uid):
        if self.delete_error:
            raise self.delete_error
        found = name in self.jobs
        self.jobs.discard(name)
        return found


def relay(ledger, kube):
    defaults = WorkerDefaults(image="retex-worker:test", service_account="retex-worker", ledger_url="http://ledger")
    return Relay(ledger, kube, lambda: defaults, interval=1.0, claim_seconds=CLAIM_SECONDS, defer_limit_seconds=DEFER_LIMIT)


def settle(batch, kube, **ledger_options):
    ledger = FakeLedger(batch, **ledger_options)
    claimed = relay(ledger, kube).relay_once()
    assert claimed == len(batch)
    return ledger.outcomes.settled


def test_one_refused_job_fails_its_own_task_and_the_records_around_it_are_sent():
    refused = Refused('jobs.batch "x" is forbidden: exceeded quota', 403)
    kube = FakeKube({f"t-{u}": live(u) for u in ("a", "b", "c")}, refuse={"b": refused})
    settled = settle([record("a"), record("b"), record("c")], kube)
    assert settled == {
        "a": ("sent", job_of("a")),
        "b": ("rejected", "JobRejected", 'jobs.batch "x" is forbidden: exceeded quota', None),
        "c": ("sent", job_of("c")),
    }
    assert kube.jobs == {job_of("a"), job_of("c")}


@pytest.mark.parametrize("reason", ["Cancelled", "TaskDeleted"])
def test_a_record_of_a_task_whose_cancel_was_requested_is_dropped_with_its_reason(reason):
    kube = FakeKube({"t-a": live("a")})
    assert settle([record("a", cancel=reason)], kube) == {"a": ("dropped", reason, None)}
    assert kube.jobs == set()


@pytest.mark.parametrize("task", [
    None,
    live("a", deletionTimestamp="2026-12-03T09:00:00Z"),
    {"metadata": {"uid": "another-uid", "name": "t-a", "namespace": "ns"}, "spec": SPEC},
], ids=["gone", "being-deleted", "a-new-task-with-its-name"])
def test_a_record_whose_task_object_is_gone_is_dropped_as_task_deleted(task):
    kube = FakeKube({"t-a": task})
    assert settle([record("a")], kube) == {"a": ("dropped", "TaskDeleted", None)}
    assert kube.jobs == set()


def test_a_cancel_on_the_live_task_the_handler_has_not_seen_yet_drops_the_record():
    kube = FakeKube({"t-a": live("a", spec=SPEC | {"cancel": True})})
    assert settle([record("a")], kube) == {"a": ("dropped", "Cancelled", None)}


def test_a_record_for_a_terminating_namespace_is_dropped_as_task_deleted():
    kube = FakeKube({"t-a": live("a")}, lease_error=NamespaceTerminating("namespace ns is being terminated", 403))
    assert settle([record("a")], kube) == {"a": ("dropped", "TaskDeleted", None)}


def test_a_record_ending_unsent_deletes_the_job_a_dead_relay_left_and_says_so():
    kube = FakeKube({"t-a": live("a")}, jobs={job_of("a")})
    assert settle([record("a", cancel="Cancelled")], kube) == {"a": ("dropped", "Cancelled", job_of("a"))}
    assert kube.jobs == set()


def test_a_record_is_not_ended_while_it_is_unknown_whether_a_job_of_it_exists():
    kube = FakeKube({"t-a": live("a")}, delete_error=ApiException(status=503, reason="Service Unavailable"))
    assert settle([record("a", cancel="Cancelled")], kube)["a"][0] == "deferred"


def test_a_record_ending_unsent_whose_job_cannot_be_checked_past_the_limit_ends_as_if_its_job_were_left():
    """A lasting failure to delete (a 403 once the namespace's RoleBinding is gone) must not keep
    the record for ever: past the limit it ends naming the Job as left, so its attempt keeps its
    slot until the reaper finds the worker gone, safe whether or not the Job exists."""
    kube = FakeKube({"t-a": live("a")}, delete_error=ApiException(status=403, reason="Forbidden"))
    settled = settle([record("a", cancel="Cancelled", deferred=DEFER_LIMIT),
                      record("b", cancel="Cancelled", deferred=DEFER_LIMIT - 1)], kube)
    assert settled["a"] == ("dropped", "Cancelled", job_of("a"))
    assert settled["b"][0] == "deferred"


def test_a_namespace_not_onboarded_past_the_limit_whose_job_cannot_be_deleted_fails_as_if_its_job_were_left():
    """The open finding's case: the RoleBinding removed, the create refused (403) past the limit,
    and the delete refused too."""
    forbidden = ApiException(status=403, reason="Forbidden")
    kube = FakeKube({"t-a": live("a")}, refuse={"a": NotPermitted("jobs is forbidden", 403)}, delete_error=forbidden)
    outcome, reason, _, job = settle([record("a", deferred=DEFER_LIMIT)], kube)["a"]
    assert (outcome, reason, job) == ("rejected", "NamespaceNotOnboarded", job_of("a"))


def test_a_transient_error_on_the_delete_defers_even_a_record_already_past_the_limit():
    """A record deferred for another reason reaches the delete past the limit: one 503 there must
    not end it with a Job that could still be deleted."""
    kube = FakeKube({"t-a": live("a")}, delete_error=ApiException(status=503, reason="Service Unavailable"))
    assert settle([record("a", cancel="Cancelled", deferred=DEFER_LIMIT)], kube)["a"][0] == "deferred"


def test_a_ledger_spec_that_differs_from_the_live_tasks_gets_no_job_and_fails_the_task():
    forged = SPEC | {"steps": [{"name": "only", "exec": {"command": ["sh", "-c", "curl evil"]}}]}
    kube = FakeKube({"t-a": live("a")})
    settled = settle([record("a", spec=forged)], kube)
    outcome, reason, message, job = settled["a"]
    assert (outcome, reason, job) == ("rejected", "SpecMismatch", None)
    assert "differs from the Task's" in message
    assert kube.jobs == set()


def test_a_transient_error_defers_that_record_alone():
    busy = ApiException(status=429, reason="Too Many Requests")
    kube = FakeKube({"t-a": live("a"), "t-b": live("b")}, refuse={"a": busy})
    settled = settle([record("a"), record("b")], kube)
    assert settled["a"][0] == "deferred" and "Too Many Requests" in settled["a"][1]
    assert settled["b"] == ("sent", job_of("b"))


def test_a_record_deferred_up_to_the_limit_fails_the_task_with_dispatch_failed():
    busy = ApiException(status=503, reason="Service Unavailable")
    kube = FakeKube({"t-a": live("a"), "t-b": live("b")}, refuse={"a": busy, "b": busy})
    settled = settle([record("a", deferred=DEFER_LIMIT), record("b", deferred=DEFER_LIMIT - 1)], kube)
    outcome, reason, message, _ = settled["a"]
    assert (outcome, reason) == ("rejected", "DispatchFailed")
    assert message.startswith(f"not dispatched for {DEFER_LIMIT:.0f}s; last error: ApiException")
    assert settled["b"][0] == "deferred"


def test_rbac_refusing_a_job_defers_it_until_the_limit_then_fails_it_as_namespace_not_onboarded():
    """An upgrade that applies the new base before onboarding the namespaces that have Tasks (or
    a GitOps tool applying them in the other order) loses no task: RBAC's 403 waits like a
    transient error, and only past the limit is the namespace judged not onboarded."""
    forbidden = NotPermitted('jobs.batch is forbidden: User "system:serviceaccount:retex-system:retex-operator" '
                             'cannot create resource "jobs"', 403)
    kube = FakeKube({"t-a": live("a"), "t-b": live("b")}, refuse={"a": forbidden, "b": forbidden})
    settled = settle([record("a"), record("b", deferred=DEFER_LIMIT)], kube)
    assert settled["a"][0] == "deferred" and "cannot create resource" in settled["a"][1]
    outcome, reason, message, _ = settled["b"]
    assert (outcome, reason) == ("rejected", "NamespaceNotOnboarded")
    assert "kubectl apply -n ns -k manifests/tenant" in message


def test_an_error_repeating_cannot_cure_fails_the_task_at_once_without_deferring():
    bad = live("a", spec={"steps": "not a list"})  # the models refuse it: the same every time
    kube = FakeKube({"t-a": bad})
    outcome, reason, message, _ = settle([record("a")], kube)["a"]
    assert (outcome, reason) == ("rejected", "DispatchFailed")
    assert message.startswith("the attempt could not be dispatched: ValidationError")


@pytest.mark.parametrize("status", [400, 403, 422])  # a 404 is no error: get_task answers None (TaskDeleted)
def test_an_api_error_on_reading_the_task_defers_the_record_until_the_limit(status):
    """Only a create's refusal is judged at once (as `Refused`); any API answer to the relay's
    own reads (the Task's GET; an RBAC warm-up's 403 after a restart, say) waits like a transient
    error, so a briefly confused API server fails no task, and past the limit the task fails."""
    error = ApiException(status=status, reason="Refused")
    kube = FakeKube({"t-a": error, "t-b": error, "t-c": live("c")})
    settled = settle([record("a"), record("b", deferred=DEFER_LIMIT), record("c")], kube)
    assert settled["a"][0] == "deferred" and f"({status})" in settled["a"][1]
    outcome, reason, message, _ = settled["b"]
    assert (outcome, reason) == ("rejected", "DispatchFailed")
    assert message.startswith(f"not dispatched for {DEFER_LIMIT:.0f}s")
    assert settled["c"] == ("sent", job_of("c"))


def test_a_failed_ownership_read_after_a_creates_conflict_defers_the_record():
    """A create answered 409 and the read of the object found there (is it ours?) failed: the
    plain ApiException that read raises is no refusal of the create, so the record waits."""
    read_failed = ApiException(status=403, reason="Forbidden")  # what KubeCalls lets through then
    kube = FakeKube({"t-a": live("a")}, refuse={"a": read_failed})
    assert settle([record("a")], kube)["a"][0] == "deferred"


def test_a_ledger_error_mid_batch_is_raised_and_ends_the_batch_settling_nothing():
    kube = FakeKube({"t-a": live("a")})
    ledger = FakeLedger([record("a", epoch=2)], attempts_error=LedgerUnavailable("postgres down"))
    with pytest.raises(LedgerUnavailable):
        relay(ledger, kube).relay_once()
    assert ledger.outcomes.settled == {}


@pytest.mark.parametrize("where", ["create_job", "delete_job_of"])
def test_a_write_refused_because_this_replica_stopped_leading_settles_nothing_and_ends_the_batch(where):
    """The batch ends there (its claims lapse, for the next leader): not a rejected task, not a
    deferral, and the records behind it are not tried."""
    not_leading = NotLeading("create Job ns/x")
    if where == "create_job":
        kube = FakeKube({f"t-{u}": live(u) for u in ("a", "b")}, refuse={"a": not_leading})
        batch = [record("a"), record("b")]
    else:
        kube = FakeKube({}, delete_error=not_leading)  # a's Task is gone: it ends unsent, after the delete
        batch = [record("a"), record("b")]
    ledger = FakeLedger(batch)
    with pytest.raises(NotLeading):
        relay(ledger, kube).relay_once()
    assert ledger.outcomes.settled == {}


def test_the_batch_is_claimed_for_the_relays_claim_time():
    ledger = FakeLedger([record("a")])
    relay(ledger, FakeKube({"t-a": live("a")})).relay_once()
    assert ledger.claims == [(Relay.batch_size, CLAIM_SECONDS)]


@pytest.mark.parametrize("ending", ["sent", "dropped", "deferred"])
def test_a_record_no_longer_the_relays_claim_is_left_as_it_is_and_the_next_records_are_settled(ending, caplog):
    """Claimed again by another relay after this claim lapsed, or settled meanwhile: whoever holds
    the record settles it; this relay says so and goes on."""
    tasks = {"t-a": live("a"), "t-b": live("b")}
    kube = FakeKube({**tasks, "t-a": None} if ending == "dropped" else tasks,
                    refuse={"a": ApiException(status=503, reason="Service Unavailable")} if ending == "deferred" else {})
    ledger = FakeLedger([record("a"), record("b")], lost={"a"})
    with caplog.at_level(logging.WARNING, logger="retex.operator.dispatch"):
        assert relay(ledger, kube).relay_once() == 2
    assert ledger.outcomes.settled == {"b": ("sent", job_of("b"))}
    assert [r.getMessage() for r in caplog.records if "no longer this relay's claim" in r.getMessage()]
