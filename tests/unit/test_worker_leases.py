"""Who may take an attempt's Lease, and the Lease bodies a worker writes: pure, no cluster."""

from datetime import UTC, datetime

import pytest

from retex.kube.leases import (
    RELEASED_BY_ANNOTATION,
    Holder,
    LeaseTiming,
    LeaseView,
    RenewalWatch,
    Verdict,
    acquired,
    format_micro_time,
    judge,
    parse_holder,
    released,
    released_by,
    renewed,
)
from retex.worker.lease import AttemptLease

ME = Holder("task-a-2-xyz", 2)
NOW = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


def lease(holder=None, renew="2026-12-02T09:59:59.000000Z", duration=5, transitions=0, annotations=None):
    spec = {"leaseDurationSeconds": duration, "leaseTransitions": transitions}
    if holder:
        spec.update(holderIdentity=holder, renewTime=renew, acquireTime=renew)
    metadata = {"name": "task-a", "namespace": "shop", "resourceVersion": "41"}
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}


def verdict_after(observations, at):
    """Feed the watch (time, body) pairs, then judge the last body at time `at`."""
    watch = RenewalWatch()
    for when, body in observations:
        watch.observe(LeaseView.of(body), when)
    return judge(LeaseView.of(observations[-1][1]), ME, watch, at, default_duration=5)


def test_holder_identity_round_trips_pod_names_containing_colons_and_dashes():
    assert parse_holder("job-x-7f-abc:12") == Holder("job-x-7f-abc", 12)
    assert parse_holder("a:b:3") == Holder("a:b", 3)
    assert parse_holder(Holder("p", 4).identity) == Holder("p", 4)
    assert parse_holder(None) is None and parse_holder("") is None


@pytest.mark.parametrize("identity", ["no-epoch", "pod:", ":3", "pod:x1", "pod:-1"])
def test_holder_identity_not_written_by_retex_is_rejected(identity):
    with pytest.raises(ValueError):
        parse_holder(identity)


def test_free_lease_is_taken_at_once():
    assert verdict_after([(0.0, lease())], 0.0) is Verdict.TAKE


def test_lease_held_by_an_older_epoch_is_taken_without_waiting_for_its_expiry():
    assert verdict_after([(0.0, lease(holder="old-pod:1"))], 0.0) is Verdict.TAKE


def test_lease_held_by_a_newer_epoch_is_refused_even_if_silent_for_long():
    body = lease(holder="new-pod:3")
    assert verdict_after([(0.0, body), (100.0, body)], 100.0) is Verdict.REFUSE


def test_lease_we_already_hold_is_retaken():
    assert verdict_after([(0.0, lease(holder=ME.identity))], 0.0) is Verdict.TAKE


def test_same_epoch_holder_seen_renewing_is_a_live_duplicate_and_refused():
    first = lease(holder="twin-pod:2", renew="2026-12-02T09:59:59.000000Z")
    later = lease(holder="twin-pod:2", renew="2026-12-02T10:00:01.000000Z")
    assert verdict_after([(0.0, first)], 0.5) is Verdict.WAIT
    assert verdict_after([(0.0, first), (1.5, later)], 1.5) is Verdict.REFUSE


def test_same_epoch_holder_silent_for_the_lease_duration_by_our_clock_is_taken():
    body = lease(holder="twin-pod:2", duration=5)
    assert verdict_after([(0.0, body), (4.9, body)], 4.9) is Verdict.WAIT
    assert verdict_after([(0.0, body), (5.0, body)], 5.0) is Verdict.TAKE


def test_silence_is_measured_from_our_first_sight_never_from_the_renew_time_written():
    # renewTime says an hour ago, but we have only just seen it: the writer's clock is not ours.
    body = lease(holder="twin-pod:2", renew="2026-12-02T09:00:00.000000Z")
    assert verdict_after([(1000.0, body)], 1000.0) is Verdict.WAIT


def test_a_change_of_holder_restarts_the_watch():
    watch = RenewalWatch()
    watch.observe(LeaseView.of(lease(holder="twin-pod:2", renew="2026-12-02T09:59:00.000000Z")), 0.0)
    watch.observe(LeaseView.of(lease(holder="twin-pod:2", renew="2026-12-02T09:59:01.000000Z")), 1.0)
    assert watch.renewals_seen == 1
    watch.observe(LeaseView.of(lease(holder="other-pod:2")), 2.0)
    assert watch.renewals_seen == 0 and watch.silent_for(3.0) == 1.0


def test_holder_not_written_by_retex_is_refused():
    assert verdict_after([(0.0, lease(holder="someone-else"))], 99.0) is Verdict.REFUSE


def test_micro_time_always_has_six_fractional_digits_in_utc():
    assert format_micro_time(NOW) == "2026-12-02T10:00:00.000000Z"
    assert format_micro_time(datetime(2026, 1, 2, 3, 4, 5, 7, tzinfo=UTC)) == "2026-01-02T03:04:05.000007Z"


def test_acquiring_sets_holder_times_duration_and_counts_a_transition():
    body = acquired(lease(holder="old-pod:1", transitions=1), ME, 7, NOW)
    assert body["spec"] == {
        "holderIdentity": ME.identity, "leaseDurationSeconds": 7, "leaseTransitions": 2,
        "acquireTime": "2026-12-02T10:00:00.000000Z", "renewTime": "2026-12-02T10:00:00.000000Z",
    }
    assert body["metadata"]["resourceVersion"] == "41"  # the write is conditional on what we read


def test_retaking_our_own_lease_is_not_a_transition():
    body = acquired(lease(holder=ME.identity, transitions=3), ME, 5, NOW)
    assert body["spec"]["leaseTransitions"] == 3
    assert body["spec"]["acquireTime"] == "2026-12-02T09:59:59.000000Z"


def test_acquiring_a_released_lease_drops_the_released_by_note():
    body = acquired(lease(annotations={RELEASED_BY_ANNOTATION: "old-pod:1", "keep": "me"}), ME, 5, NOW)
    assert body["metadata"]["annotations"] == {"keep": "me"}


def test_renewing_changes_only_the_renew_time():
    before = acquired(lease(), ME, 5, NOW)
    after = renewed(before, datetime(2026, 12, 2, 10, 0, 2, tzinfo=UTC))
    assert after["spec"] == {**before["spec"], "renewTime": "2026-12-02T10:00:02.000000Z"}


def test_releasing_clears_the_holder_keeps_history_and_says_who_released():
    held = acquired(lease(transitions=4), ME, 5, NOW)
    body = released(held, NOW)
    assert "holderIdentity" not in body["spec"]
    assert body["spec"]["leaseTransitions"] == 5 and body["spec"]["acquireTime"] == held["spec"]["acquireTime"]
    assert released_by(body) == ME
    assert released_by(held) is None  # held, so not released
    assert released_by(lease()) is None  # never taken


def test_lease_timing_kills_the_step_before_the_operator_can_judge_the_lease_expired():
    timing = LeaseTiming.of(15)
    assert (timing.duration, timing.renew_deadline, timing.retry_period) == (15, 10, 2)
    for duration in (5, 15, 60, 600):  # the API's range
        t = LeaseTiming.of(duration)
        assert t.renew_deadline + t.kill < t.duration
        assert t.request_timeout <= t.retry_period or t.request_timeout == 0.5


def test_a_task_renew_deadline_is_used_only_if_it_keeps_the_invariant_with_the_jobs_duration():
    assert LeaseTiming.of(15, 12).renew_deadline == 12
    assert LeaseTiming.of(10, 12).renew_deadline == pytest.approx(20 / 3)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_seen_lost_stays_lost_when_a_renewal_sent_before_the_deadline_succeeds_after_it():
    # The renewal's answer arrives late (the API server slow, a proxy): by then the worker has
    # seen the deadline pass and is killing its step. A lease that comes back to life would let
    # another part of the worker (the next step boundary, a deadline wait) carry on.
    clock = FakeClock()
    lease = AttemptLease(None, "ns", "lease", Holder("pod-a", 1), LeaseTiming.of(15), clock=clock)
    lease._last_renewal, lease._body = clock.now, {"metadata": {}, "spec": {}}
    clock.now += 9.5  # the last try before the 10 s renew deadline is sent ...

    def answered_late(body):
        clock.now += 1.0  # ... and its answer comes after the deadline
        assert not lease.still_held()  # meanwhile the step was killed
        return body

    lease._replace = answered_late  # the API call's answer only: the timing logic is under test
    lease._renew_once()
    assert not lease.still_held()
