"""The lease observer's bookkeeping on the operator's clock, and the reaper's pure verdicts: blind
spots are forgiven but never reset a timer, a GET confirms what a stale watch showed, and a pod
that cannot start is described by the reasons Kubernetes gives."""

import json
from types import SimpleNamespace

from kubernetes import client

from retex.kube.leasewatch import LeaseObserver
from retex.operator.reaper import Hold, hold_of

R1, R2, R9 = "2026-12-02T16:00:01.000000Z", "2026-12-02T16:00:02.000000Z", "2026-12-02T16:00:09.000000Z"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def lease(renew: str, holder: str | None = "worker-pod:1", duration: int = 15) -> dict:
    return {"metadata": {"name": "t-abc", "namespace": "ns", "labels": {"retex.dev/task-uid": "uid-1"}},
            "spec": {"holderIdentity": holder, "renewTime": renew, "leaseDurationSeconds": duration}}


def observer(clock):
    return LeaseObserver(client.ApiClient(), clock=clock)


def test_a_watch_that_keeps_failing_still_expires_a_dead_worker_after_its_duration_plus_the_blind_time():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease(R1)])  # the worker renews for the last time, then dies
    for _ in range(4):  # the watch fails every 5 s and is blind for 1 s each time
        clock.now += 4
        leases.went_blind()
        clock.now += 1
        leases.relisted([lease(R1)])
    # 20 s after the last renewal, 4 of them blind: 16 s seen > 15 s duration.
    assert hold_of(leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.EXPIRED


def test_a_long_blind_spot_gives_a_live_worker_its_grace_back():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease(R1)])
    clock.now += 10
    leases.went_blind()  # the API server restarts: nobody can renew for 30 s
    clock.now += 30
    leases.relisted([lease(R1)])
    assert hold_of(leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.HELD
    clock.now += 6  # 10 s seen before the outage + 6 s after: past the duration
    assert hold_of(leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.EXPIRED


def test_a_get_that_shows_a_renewal_the_stalled_watch_missed_keeps_the_worker_alive():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease(R1)])
    clock.now += 40  # the watch stalled (or the operator was paused): nothing seen for 40 s
    assert hold_of(leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.EXPIRED
    assert hold_of(leases.confirm("ns", "t-abc", "uid-1", lease(R9)), 1, clock.now) is Hold.HELD


def test_the_same_renewal_read_by_get_is_not_mistaken_for_a_new_one():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease("2026-12-02T16:33:00.123456Z")])  # as a watch event spells it
    clock.now += 16
    # As the client's serializer spells the same instant after a GET:
    confirmed = leases.confirm("ns", "t-abc", "uid-1", lease("2026-12-02T16:33:00.123456+00:00"))
    assert hold_of(confirmed, 1, clock.now) is Hold.EXPIRED


def test_a_get_that_shows_no_renewal_confirms_the_expiry():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease(R1)])
    clock.now += 16
    assert hold_of(leases.confirm("ns", "t-abc", "uid-1", lease(R1)), 1, clock.now) is Hold.EXPIRED
    assert leases.confirm("ns", "t-abc", "uid-1", None) is None  # the Lease is gone


def test_a_lease_deleted_while_the_watch_was_blind_is_forgotten_at_the_relist():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease(R1)])
    leases.went_blind()
    leases.relisted([])
    assert leases.get("ns", "t-abc", "uid-1") is None


def test_released_and_other_epochs_are_told_apart():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease(R1)])
    leases.confirm("ns", "t-abc", "uid-1", lease(R2, holder=None))
    assert hold_of(leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.RELEASED
    assert hold_of(leases.get("ns", "t-abc", "uid-1"), 2, clock.now) is Hold.NEVER
    assert hold_of(None, 1, clock.now) is Hold.NEVER


def forged(renew: str) -> dict:
    """A Lease another namespace's tenant made: same name, the victim's task-uid label, renewed."""
    body = lease(renew)
    body["metadata"]["namespace"] = "attacker"
    return body


def test_a_lease_forged_in_another_namespace_with_the_victims_label_does_not_keep_its_dead_worker_alive():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease(R1)])  # the victim's worker renews for the last time, then dies
    for renew in (R2, R9):  # the attacker keeps renewing a Lease labelled as the victim's
        clock.now += 8
        leases.relisted([lease(R1), forged(renew)])
    assert hold_of(leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.EXPIRED


def test_a_new_leader_gives_every_worker_lease_a_fresh_grace_period_from_its_takeover():
    clock = Clock()
    leases = observer(clock)
    leases.relisted([lease(R1)])  # seen as a standby, 14 s ago
    clock.now += 14
    leases.grant_grace()  # this replica now leads
    clock.now += 14
    assert not leases.get("ns", "t-abc", "uid-1").expired(clock.now), \
        "a failover must not condemn a worker on what a standby saw"
    clock.now += 1.1
    assert leases.get("ns", "t-abc", "uid-1").expired(clock.now), "a dead worker is still replaced after the grace"


def test_the_watch_survives_a_stream_that_breaks_and_relists(monkeypatch):
    """An API-server restart ends the watch stream mid-way: the watcher must log, relist and
    watch again, never die (a dead watch leaves the reaper blind for good)."""
    import urllib3

    import retex.kube.watching as watching

    leases = observer(Clock())
    lists = []

    def list_leases(**kwargs):
        lists.append(kwargs)
        if len(lists) >= 2:
            leases.stop()
        return SimpleNamespace(data=json.dumps({"items": [], "metadata": {"resourceVersion": str(len(lists))}}).encode())

    class BrokenStream:
        def stream(self, *args, **kwargs):
            yield {"type": "ADDED", "raw_object": {**lease(R1), "metadata": {**lease(R1)["metadata"],
                                                                              "resourceVersion": "1"}}}
            raise urllib3.exceptions.ProtocolError("Response ended prematurely")

        def stop(self):
            pass

    monkeypatch.setattr(leases._coordination, "list_lease_for_all_namespaces", list_leases)
    monkeypatch.setattr(watching.watch, "Watch", BrokenStream)
    monkeypatch.setattr(leases._stop, "wait", lambda seconds: None)
    leases.run()  # returns once stopped; a crash in the error path would raise here
    assert len(lists) == 2, "relisted after the broken stream"
