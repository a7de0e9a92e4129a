"""The operator's API calls in the time a leader has: every call carries the request timeout
derived from the election (D − R: a call sent before the renew deadline is answered or given up
by the lease duration, when a successor may start), and a write is not sent at all once this
replica does not lead."""

from __future__ import annotations

import inspect

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from retex.kube.election import Election, ElectionTiming, LeaderLease, LeaderRecord
from retex.kube.operator_calls import LIST_TIMEOUT_SECONDS, KubeCalls, NotLeading

TASK = {"apiVersion": "retex.dev/v1alpha1", "kind": "Task",
        "metadata": {"name": "order-1", "namespace": "shop", "uid": "u-1"}}
OBJECT = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "order-1-1", "namespace": "shop", "ownerReferences": [
    {"apiVersion": "retex.dev/v1alpha1", "kind": "Task", "name": "order-1", "uid": "u-1"}]}}
# One way to call each of KubeCalls' methods.
EVERY_CALL = {
    "create_lease": lambda c: c.create_lease({**OBJECT, "kind": "Lease"}),
    "create_job": lambda c: c.create_job(OBJECT),
    "dry_run_job": lambda c: c.dry_run_job(OBJECT),
    "get_job": lambda c: c.get_job("shop", "order-1-1"),
    "delete_job_of": lambda c: c.delete_job_of("shop", "order-1-1", "u-1"),
    "delete_job": lambda c: c.delete_job("shop", "order-1-1"),
    "get_task": lambda c: c.get_task("shop", "order-1"),
    "list_tasks": lambda c: list(c.list_tasks()),
    "namespace_run_limits": lambda c: c.namespace_run_limits(),
    "patch_task_status": lambda c: c.patch_task_status("shop", "order-1", "u-1", {}),
    "patch_task_labels": lambda c: c.patch_task_labels("shop", "order-1", "u-1", {"a": "b"}),
    "post_event": lambda c: c.post_event(TASK, reason="Started", message="m"),
    "get_lease": lambda c: c.get_lease("shop", "order-1"),
    "job_pods": lambda c: c.job_pods("shop", "order-1-1"),
    "job_events": lambda c: c.job_events("shop", "order-1-1"),
    "node_labelled": lambda c: c.node_labelled({"disk": "nvme"}),
}
WRITES = {"create_lease", "create_job", "delete_job", "patch_task_status", "patch_task_labels", "post_event"}


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, str, object]]:
    """Every request the client would send: (method, path, its _request_timeout), answered 500."""
    requests: list[tuple[str, str, object]] = []

    def call_api(self, path, method, *args, **kwargs):
        requests.append((method, path, kwargs.get("_request_timeout")))
        raise ApiException(status=500)

    monkeypatch.setattr(client.ApiClient, "call_api", call_api)
    return requests


def test_every_call_is_listed_here():
    public = {name for name, _ in inspect.getmembers(KubeCalls, inspect.isfunction) if not name.startswith("_")}
    assert public == set(EVERY_CALL)


@pytest.mark.parametrize("name", sorted(EVERY_CALL))
def test_every_call_carries_the_request_timeout(name, sent):
    with pytest.raises(Exception):  # noqa: B017 - answered 500: how each call reports it is not the point
        EVERY_CALL[name](KubeCalls(client.ApiClient(), instance="a", request_timeout=1.5))
    # D − R bounds writes; a LIST is a read
    expected = LIST_TIMEOUT_SECONDS if name in ("list_tasks", "namespace_run_limits") else 1.5
    assert sent and all(timeout == expected for _, _, timeout in sent), sent


@pytest.mark.parametrize("name", sorted(WRITES))
def test_a_write_is_not_sent_once_this_replica_does_not_lead(name, sent):
    calls = KubeCalls(client.ApiClient(), instance="a", request_timeout=1.5, may_write=lambda: False)
    with pytest.raises(NotLeading, match="not the leader: .* not sent"):
        EVERY_CALL[name](calls)
    assert sent == []


def test_the_election_lease_calls_carry_the_timeout_they_are_given(sent):
    lease = LeaderLease(client.ApiClient(), "retex-system")
    for call in (lambda: lease.read(timeout=0.5), lambda: lease.write(LeaderRecord(holder="a", duration_seconds=15), timeout=0.7)):
        with pytest.raises(ApiException):
            call()
    assert [timeout for _, _, timeout in sent] == [0.5, 0.7]


@pytest.mark.parametrize("timing, calls", [
    (ElectionTiming(), 5.0),  # client-go's 15/10/2 s
    (ElectionTiming(lease_duration=4, renew_deadline=3, retry_period=0.5), 1.0),  # the tests' timings
    (ElectionTiming(lease_duration=15, renew_deadline=14, retry_period=2), 1.0),  # a tight margin
])
def test_the_request_timeout_is_what_is_left_of_the_lease_after_the_renew_deadline(timing, calls):
    assert timing.request_timeout == calls
    # A call sent at the last moment a leader may write is over by the time a successor may start.
    assert timing.renew_deadline + timing.request_timeout <= timing.lease_duration


@pytest.mark.parametrize("timing", [ElectionTiming(), ElectionTiming(lease_duration=4, renew_deadline=3, retry_period=0.5)])
def test_an_election_call_is_over_before_a_successor_may_start(timing):
    """A leader's call may take until its renew deadline, anyone else's D − R: sent at any moment,
    it is over by the lease duration after the last renewal, when a successor may start."""
    election = Election("a", timing)
    assert election.call_timeout(0.0) == timing.request_timeout  # never renewed
    election.won(LeaderRecord(holder="a", duration_seconds=15), started_at=100.0)
    for sent_at in (100.0, 100.5, 100.0 + timing.renew_deadline - 0.01):
        timeout = election.call_timeout(sent_at)
        assert timeout == pytest.approx(100.0 + timing.renew_deadline - sent_at)
        assert sent_at + timeout <= 100.0 + timing.lease_duration
    past_deadline = 100.0 + timing.renew_deadline
    assert election.call_timeout(past_deadline) == timing.request_timeout
    assert past_deadline + timing.request_timeout <= 100.0 + timing.lease_duration
