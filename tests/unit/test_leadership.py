"""The election's thread (retex.operator.leadership) on a fake election Lease: what a replica does
as it becomes leader happens before any writer hears that it leads."""

from __future__ import annotations

import threading

from retex.kube.election import ElectionTiming, LeaderRecord
from retex.operator.leadership import Leadership

TIMING = ElectionTiming(lease_duration=15, renew_deadline=10, retry_period=2)


class NoLeaseYet:
    """The election Lease's calls, in memory: none exists until the first write."""

    def __init__(self):
        self.record = None

    def read(self):
        return self.record

    def write(self, record):
        self.record = record


def test_a_replica_taking_over_starts_its_term_before_any_writer_hears_that_it_leads():
    said: list[str] = []
    writer_answered = threading.Event()

    def writer() -> None:  # a writer loop, asking right before a round
        leading = leadership.leading()
        said.append(f"writer told leading={leading}")
        writer_answered.set()

    def on_started() -> None:  # the Runtime's takeover: the fresh grace for every worker lease
        threading.Thread(target=writer).start()
        # Proves a negative, so a timed window: a writer that asks now gets no answer yet.
        if writer_answered.wait(0.5):
            said.append("writer answered while the term was starting")
        said.append("grace granted")

    leadership = Leadership(NoLeaseYet(), "replica-a", TIMING, on_started=on_started)
    leadership.try_acquire_or_renew()
    assert writer_answered.wait(10), "the writer never got an answer"
    assert said == ["grace granted", "writer told leading=True"]
    assert leadership.leading()


class FreeLease:
    """A Lease whose record a test sets (another replica's writes) and this replica writes."""

    def __init__(self) -> None:
        self.record: LeaderRecord | None = None

    def read(self) -> LeaderRecord | None:
        return self.record

    def write(self, record: LeaderRecord) -> None:
        self.record = record


def test_a_leader_that_takes_the_lease_again_after_a_pause_starts_a_new_leadership():
    """A paused past the lease duration; B took over and released the Lease meanwhile. A's first
    round after it resumes takes the free Lease: that is a new leadership (fresh grace, a new
    ledger term), though no round of A's ever noticed it had stopped leading."""
    now = [0.0]
    started: list[float] = []
    lease = FreeLease()
    timing = ElectionTiming(lease_duration=15, renew_deadline=10, retry_period=2)
    a = Leadership(lease, "a", timing, on_started=lambda: started.append(now[0]), clock=lambda: now[0])
    a.try_acquire_or_renew()
    assert a.leading() and started == [0.0]
    now[0] = 60.0
    lease.record = LeaderRecord(holder=None, duration_seconds=15, transitions=2)  # B took it, then released it
    assert not a.leading()
    a.try_acquire_or_renew()
    assert a.leading()
    assert started == [0.0, 60.0]
    now[0] = 62.0
    a.try_acquire_or_renew()  # a renewal is no new leadership
    assert started == [0.0, 60.0]
