"""The operator's Runtime as built for a replica (a real ledger; the election Lease and the lease
watch's clock faked, no thread started) becoming leader: a worker lease it saw renewed only long
ago, as a standby whose watch was stalled, is not judged by that view (the takeover's fresh grace,
Runtime._lead); a dead worker is still judged one lease duration after the takeover."""

from __future__ import annotations

from kubernetes import client

from retex.kube.leasewatch import LeaseObserver
from retex.operator import handlers
from retex.operator.reaper import Hold, hold_of
from retex.operator.settings import OperatorSettings
from tests.unit.test_leadership import NoLeaseYet
from tests.unit.test_lease_observations import R1, Clock, lease


def test_a_replica_that_becomes_leader_condemns_no_worker_for_what_it_missed_as_a_standby(dsn, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(handlers, "api_client", client.ApiClient)  # never called: no thread starts
    monkeypatch.setattr(handlers, "LeaderLease", lambda *_, **__: NoLeaseYet())
    monkeypatch.setattr(handlers, "install_uid", lambda *_, **__: "an-install")  # its Lease is read at start
    monkeypatch.setattr(handlers, "LeaseObserver", lambda api: LeaseObserver(api, clock=clock))
    runtime = handlers.Runtime(OperatorSettings.from_env({"RETEX_DATABASE_URL": dsn, "RETEX_DATABASE_INSECURE": "1",
                                                                 "RETEX_LEDGER_INSECURE": "1"}))
    try:
        runtime.leases.relisted([lease(R1)])  # the worker's renewal, seen by this standby ...
        clock.now += 60  # ... then nothing: its watch stalled while the worker kept renewing
        assert hold_of(runtime.leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.EXPIRED
        runtime.leadership.try_acquire_or_renew()
        assert runtime.leadership.leading()
        assert hold_of(runtime.leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.HELD
        clock.now += 16  # a lease duration (15 s) after the takeover: a dead worker is judged
        assert hold_of(runtime.leases.get("ns", "t-abc", "uid-1"), 1, clock.now) is Hold.EXPIRED
    finally:
        for ledger in (runtime.ledger, runtime.worker_ledger, runtime.metrics_ledger):
            ledger.close()
