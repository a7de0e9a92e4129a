"""The operator's leader election as a pure state machine on an injected clock (client-go's
shape): who creates, renews, takes or waits, and until when a leader may write."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from retex.kube.election import Decision, Election, ElectionTiming, LeaderRecord

TIMING = ElectionTiming(lease_duration=15, renew_deadline=10, retry_period=2)
WALL = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def held_by(holder: str | None, renewed: str = "2026-12-03T12:00:00.000000Z", transitions: int = 0) -> LeaderRecord:
    return LeaderRecord(holder=holder, duration_seconds=15, acquire_time="2026-12-03T11:00:00.000000Z",
                        renew_time=renewed, transitions=transitions)


def test_the_defaults_are_client_gos_15_10_2_seconds():
    assert ElectionTiming() == ElectionTiming(lease_duration=15, renew_deadline=10, retry_period=2)


@pytest.mark.parametrize("duration, deadline, retry", [
    (10, 10, 2),  # the renew deadline must be shorter than the lease duration
    (15, 12, 11),  # and longer than 1.2 retry periods
    (15, 10, 0),
    (-1, 10, 2),
])
def test_timings_that_could_let_two_leaders_write_are_refused(duration, deadline, retry):
    with pytest.raises(ValueError):
        ElectionTiming(lease_duration=duration, renew_deadline=deadline, retry_period=retry)


def test_with_no_lease_the_candidate_creates_it_and_leads_from_the_start_of_that_write():
    election = Election("a", TIMING)
    election.observe(None, now=100.0)
    assert election.decide(100.0) is Decision.CREATE
    record = election.record(Decision.CREATE, WALL)
    assert (record.holder, record.duration_seconds, record.transitions) == ("a", 15, 0)
    assert record.renew_time == record.acquire_time == "2026-12-03T12:00:00.000000Z"
    election.won(record, started_at=100.0)
    assert election.leading(109.9)
    assert not election.leading(110.0), "a leader must stop at its renew deadline"


def test_a_lease_another_replica_renewed_is_waited_for_until_it_is_silent_for_its_duration():
    election = Election("b", TIMING)
    election.observe(held_by("a"), now=100.0)
    assert election.decide(114.9) is Decision.WAIT
    election.observe(held_by("a"), now=114.9)  # the same record again: not a renewal
    assert election.decide(115.0) is Decision.TAKE
    taken = election.record(Decision.TAKE, WALL)
    assert (taken.holder, taken.transitions) == ("b", 1)


def test_a_renewal_seen_restarts_the_wait_measured_on_our_own_clock():
    election = Election("b", TIMING)
    election.observe(held_by("a", renewed="2026-12-03T12:00:00.000000Z"), now=100.0)
    election.observe(held_by("a", renewed="2026-12-03T12:00:02.000000Z"), now=110.0)
    assert election.decide(124.9) is Decision.WAIT
    assert election.decide(125.0) is Decision.TAKE


def test_a_released_lease_is_taken_at_once():
    election = Election("b", TIMING)
    election.observe(held_by(None), now=100.0)
    assert election.decide(100.0) is Decision.TAKE


def test_the_holder_renews_keeping_its_acquire_time_and_the_transition_count():
    election = Election("a", TIMING)
    election.observe(held_by("a", transitions=3), now=100.0)
    assert election.decide(100.0) is Decision.RENEW
    renewed = election.record(Decision.RENEW, WALL)
    assert (renewed.acquire_time, renewed.transitions) == ("2026-12-03T11:00:00.000000Z", 3)
    assert renewed.renew_time == "2026-12-03T12:00:00.000000Z"


def test_a_leader_whose_renewals_fail_stops_leading_at_the_deadline_before_anyone_may_take_over():
    leader, standby = Election("a", TIMING), Election("b", TIMING)
    leader.observe(None, now=0.0)
    record = leader.record(Decision.CREATE, WALL)
    leader.won(record, started_at=0.0)
    standby.observe(record, now=0.3)  # the standby can only see the write after it began
    # From here every renewal fails (partition): the leader's clock runs on.
    assert leader.leading(9.9) and not leader.leading(10.0)
    assert standby.decide(10.0) is Decision.WAIT, "the old leader may still write until 10 s"
    assert standby.decide(15.3) is Decision.TAKE
    assert not leader.leading(15.3)


def test_a_leader_that_lost_the_lease_to_another_does_not_renew_it():
    election = Election("a", TIMING)
    election.observe(None, now=0.0)
    election.won(election.record(Decision.CREATE, WALL), started_at=0.0)
    election.observe(held_by("b", transitions=1), now=20.0)  # it was paused; b took over meanwhile
    assert not election.leading(20.0)
    assert election.decide(20.0) is Decision.WAIT


def test_a_leader_that_steps_down_frees_the_lease_and_stops_leading():
    election = Election("a", TIMING)
    election.observe(None, now=0.0)
    election.won(election.record(Decision.CREATE, WALL), started_at=0.0)
    released = election.released_record(WALL)
    assert released.holder is None and released.transitions == 0
    election.released(released, now=1.0)
    assert not election.leading(1.0)


def test_a_fractional_lease_duration_is_written_rounded_up_never_shorter_than_the_leaders_deadline():
    election = Election("a", ElectionTiming(lease_duration=3.5, renew_deadline=3, retry_period=0.5))
    election.observe(None, now=0.0)
    assert election.record(Decision.CREATE, WALL).duration_seconds == 4


def test_a_lease_read_back_from_the_api_server_is_the_record_written():
    record = held_by("a", transitions=2)
    assert LeaderRecord.of({"spec": record.spec()}) == record
