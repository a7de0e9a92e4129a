"""The election's thread (retex.operator.leadership) on a fake election Lease: what a replica does
as it becomes leader happens before any writer hears that it leads."""

from __future__ import annotations

import threading

from retex.kube.election import ElectionTiming, LeaderRecord
from retex.kube.leases import LeaseConflict
from retex.operator.leadership import Leadership

TIMING = ElectionTiming(lease_duration=15, renew_deadline=10, retry_period=2)


class NoLeaseYet:
    """The election Lease, in memory: none exists until the first write. Writes are conditional, as
    LeaderLease's: on the version this replica last read or wrote (a create on there being none),
    else LeaseConflict. Setting `record` is another replica's write. `calls` lists (call, timeout)."""

    def __init__(self):
        self._record: LeaderRecord | None = None
        self._version = 0  # the server's resourceVersion
        self._seen: int | None = None  # ours: the version of the last read or write (None: none read)
        self.calls: list[tuple[str, float]] = []

    @property
    def record(self) -> LeaderRecord | None:
        return self._record

    @record.setter
    def record(self, record: LeaderRecord | None) -> None:
        self._record, self._version = record, self._version + 1

    def read(self, *, timeout: float) -> LeaderRecord | None:
        self.calls.append(("read", timeout))
        self._seen = self._version if self._record is not None else None
        return self._record

    def write(self, record: LeaderRecord, *, timeout: float) -> None:
        self.calls.append(("write", timeout))
        if self._seen != (self._version if self._record is not None else None):
            raise LeaseConflict("written by another replica since")
        self.record = record
        self._seen = self._version


def test_a_replica_taking_over_starts_its_term_before_any_writer_hears_that_it_leads():
    said: list[str] = []
    writer_answered = threading.Event()
    lock_free_meanwhile: list[bool] = []

    def writer() -> None:  # a writer loop, asking right before a round
        leading = leadership.leading()
        said.append(f"writer told leading={leading}")
        writer_answered.set()

    def try_the_lock() -> None:  # what leading() takes, tried by another thread: never waits
        free = leadership._lock.acquire(blocking=False)
        if free:
            leadership._lock.release()
        lock_free_meanwhile.append(free)

    def on_started() -> None:  # the Runtime's takeover: the fresh grace for every worker lease
        threading.Thread(target=writer).start()
        probe = threading.Thread(target=try_the_lock)
        probe.start()
        probe.join()
        said.append("grace granted")

    leadership = Leadership(NoLeaseYet(), "replica-a", TIMING, on_started=on_started)
    leadership.try_acquire_or_renew()
    # Held throughout on_started, so the writer's leading() waited: no timed window needed.
    assert lock_free_meanwhile == [False], "a writer could have asked leading() while the term was starting"
    assert writer_answered.wait(10), "the writer never got an answer"
    assert said == ["grace granted", "writer told leading=True"]
    assert leadership.leading()

class SharedLease(NoLeaseYet):
    """One election Lease two replicas read and write, in memory (no conflicts: they take turns)."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, record, *, timeout):
        self.writes.append(record)
        super().write(record, timeout=timeout)


def failing_on_started() -> None:
    raise RuntimeError("grant_grace: the lease observer is not running")


def test_a_replica_whose_takeover_fails_gives_the_lease_up_so_a_standby_takes_over():
    lease, now = SharedLease(), [100.0]
    a = Leadership(lease, "replica-a", TIMING, on_started=failing_on_started, clock=lambda: now[0])
    b = Leadership(lease, "replica-b", TIMING, on_started=lambda: None, clock=lambda: now[0])
    a.try_acquire_or_renew()
    assert not a.leading()
    assert lease.record.holder is None, "a replica that does not lead must not keep the Lease"
    now[0] += TIMING.retry_period
    b.try_acquire_or_renew()
    assert b.leading() and lease.record.holder == "replica-b"
    now[0] += TIMING.retry_period
    a.try_acquire_or_renew()  # it does not take it back: b renewed it a retry period ago
    assert b.leading() and not a.leading() and lease.record.holder == "replica-b"


def test_a_takeover_that_ran_past_the_renew_deadline_gives_the_lease_up():
    lease, now = SharedLease(), [100.0]

    def slow_on_started() -> None:
        now[0] += TIMING.renew_deadline  # the Lease written at the start is stale by the end

    a = Leadership(lease, "replica-a", TIMING, on_started=slow_on_started, clock=lambda: now[0])
    a.try_acquire_or_renew()
    assert not a.leading() and lease.record.holder is None


def test_a_takeover_that_fails_once_is_tried_again_and_then_leads():
    lease, now, calls = SharedLease(), [100.0], []

    def on_started() -> None:
        calls.append(now[0])
        if len(calls) == 1:
            raise RuntimeError("the API server did not answer")

    a = Leadership(lease, "replica-a", TIMING, on_started=on_started, clock=lambda: now[0])
    a.try_acquire_or_renew()
    assert not a.leading()
    now[0] += TIMING.lease_duration  # no standby took it meanwhile
    a.try_acquire_or_renew()
    assert a.leading() and lease.record.holder == "replica-a" and len(calls) == 2


def test_on_started_may_ask_whether_this_replica_leads_and_hears_not_yet():
    heard = []
    leadership = Leadership(NoLeaseYet(), "replica-a", TIMING, on_started=lambda: heard.append(leadership.leading()))
    election = threading.Thread(target=leadership.try_acquire_or_renew, daemon=True)
    election.start()
    election.join(timeout=10)  # only there to report a deadlock: it returns at once
    assert not election.is_alive(), "on_started asking leading() deadlocked the election thread"
    assert heard == [False] and leadership.leading()


FreeLease = NoLeaseYet  # a Lease whose record a test sets (another replica's writes) and this replica writes


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


def test_a_restarted_leader_stops_leading_at_once_and_starts_a_new_leadership_on_its_next_renewal():
    """`restart` (the ledger refused a write of this leader's term): no writer hears "leading"
    until a Lease write has proved this replica still holds the Lease, and that write starts a
    new leadership (on_started: a new ledger term) rather than continue the old one."""
    now, started = [0.0], []
    lease = FreeLease()
    a = Leadership(lease, "a", TIMING, on_started=lambda: started.append(now[0]), clock=lambda: now[0])
    a.try_acquire_or_renew()
    assert a.leading() and started == [0.0]
    now[0] = 2.0
    a.restart()
    assert not a.leading()
    a.try_acquire_or_renew()  # still its Lease: a renewal, proved by the write, and a new leadership
    assert a.leading() and started == [0.0, 2.0]
    assert lease.record is not None and lease.record.holder == "a"


def test_a_restart_during_a_renewal_under_way_still_starts_a_new_leadership():
    now, started = [0.0], []
    a: Leadership

    class RestartedWhileWriting(FreeLease):
        def write(self, record: LeaderRecord, *, timeout: float) -> None:
            if started:  # the renewal after the first takeover: the ledger refuses a write meanwhile
                a.restart()
            super().write(record, timeout=timeout)

    a = Leadership(RestartedWhileWriting(), "a", TIMING, on_started=lambda: started.append(now[0]),
                   clock=lambda: now[0])
    a.try_acquire_or_renew()
    now[0] = 2.0
    a.try_acquire_or_renew()
    assert a.leading() and started == [0.0, 2.0]


def test_a_takeover_after_a_renewal_that_stalled_while_it_still_led_is_a_new_leadership():
    """A's round starts while it leads (t=8, renewed at 0); its renewal stalls until t=16,
    meanwhile B took the Lease (at D) and released it. The renewal conflicts, A reads the free
    Lease and takes it: a new leadership (on_started, a new ledger term), though A was leading
    when the round started."""
    now, started = [0.0], []
    b_released = LeaderRecord(holder=None, duration_seconds=15, transitions=2)

    class StallingWrite(FreeLease):
        stall = False

        def write(self, record: LeaderRecord, *, timeout: float) -> None:
            if self.stall:
                self.stall, now[0] = False, 16.0
                self.record = b_released
            super().write(record, timeout=timeout)

    lease = StallingWrite()
    a = Leadership(lease, "a", TIMING, on_started=lambda: started.append(now[0]), clock=lambda: now[0])
    a.try_acquire_or_renew()
    now[0], lease.stall = 8.0, True
    a.try_acquire_or_renew()
    assert started == [0.0, 16.0], "a takeover counted as continuing the leadership before it"
    assert lease.record is not None and lease.record.holder == "a"


def test_a_leader_renews_with_one_write_and_reads_only_when_someone_else_wrote():
    """client-go's fast path: a leader's renewal is one conditional write, no read first; a
    conflict (the Lease changed) sends it to read and decide on what is there, in the same round."""
    now = [0.0]
    lease = NoLeaseYet()
    a = Leadership(lease, "a", TIMING, on_started=lambda: None, clock=lambda: now[0])
    a.try_acquire_or_renew()
    assert [call for call, _ in lease.calls] == ["read", "write"]  # no Lease yet: read, create
    for _ in range(3):
        now[0] += TIMING.retry_period
        a.try_acquire_or_renew()
    assert [call for call, _ in lease.calls[2:]] == ["write"] * 3
    assert a.leading()
    del lease.calls[:]
    now[0] += TIMING.retry_period
    lease.record = LeaderRecord(holder="b", duration_seconds=15, renew_time="b's", transitions=1)  # taken meanwhile
    a.try_acquire_or_renew()
    assert [call for call, _ in lease.calls] == ["write", "read"]
    assert lease.record.holder == "b", "a renewal overwrote another replica's Lease"
    now[0] += TIMING.renew_deadline
    assert not a.leading()


def test_a_leaders_calls_may_take_until_its_renew_deadline_and_anyone_elses_d_minus_r():
    now = [0.0]
    lease = NoLeaseYet()
    a = Leadership(lease, "a", TIMING, on_started=lambda: None, clock=lambda: now[0])
    a.try_acquire_or_renew()  # not leading yet: D − R for both
    assert [timeout for _, timeout in lease.calls] == [TIMING.request_timeout] * 2
    now[0] = 3.0  # renewed at 0: 7 s left of its renew deadline
    a.try_acquire_or_renew()
    assert lease.calls[-1] == ("write", TIMING.renew_deadline - 3.0)


def test_a_leader_whose_api_server_answers_slower_than_its_retry_period_keeps_leading():
    """The scale benchmark on kind (docs/benchmarks.md): every election call answered in about
    0.8 s, past the tests' retry period (0.5 s), each given up at 0.5 s: 17 lost leaderships. With
    the tests' timings (4/3/0.5 s), calls answered in 0.8 s keep the leadership for good."""
    timing = ElectionTiming(lease_duration=4, renew_deadline=3, retry_period=0.5)
    answer_after = 0.8
    now, started = [0.0], []

    class SlowApiServer(NoLeaseYet):
        def read(self, *, timeout):
            self._wait(timeout)
            return super().read(timeout=timeout)

        def write(self, record, *, timeout):
            self._wait(timeout)
            super().write(record, timeout=timeout)

        def _wait(self, timeout):
            now[0] += min(timeout, answer_after)
            if timeout < answer_after:
                raise TimeoutError(f"no answer within {timeout} s")

    a = Leadership(SlowApiServer(), "a", timing, on_started=lambda: started.append(now[0]), clock=lambda: now[0])
    a.try_acquire_or_renew()
    assert a.leading(), "a slow API server's first answers should have made this replica leader"
    lost_at = []
    for _ in range(40):  # the thread's loop: a round, then a retry period's wait
        now[0] += timing.retry_period
        a.try_acquire_or_renew()
        if not a.leading():
            lost_at.append(now[0])
    assert lost_at == [] and len(started) == 1, f"stopped leading at {lost_at}"


def test_a_leader_that_may_not_keep_the_lease_gives_it_up_and_rests_a_lease_duration():
    """A leader that could not take the ledger's term for a lease duration (`may_keep` says no)
    releases the Lease so a standby that can takes over, and does not take it back before D."""
    lease, now, keep = SharedLease(), [100.0], [True]
    a = Leadership(lease, "replica-a", TIMING, on_started=lambda: None, clock=lambda: now[0],
                   may_keep=lambda: keep[0])
    a.try_acquire_or_renew()
    assert a.leading()
    keep[0] = False
    now[0] += TIMING.retry_period
    a.try_acquire_or_renew()
    assert not a.leading() and lease.record.holder is None
    keep[0] = True
    now[0] += TIMING.retry_period
    a.try_acquire_or_renew()  # resting: the free Lease is left to a standby
    assert not a.leading() and lease.record.holder is None
    b = Leadership(lease, "replica-b", TIMING, on_started=lambda: None, clock=lambda: now[0])
    b.try_acquire_or_renew()
    assert b.leading() and lease.record.holder == "replica-b"


def test_a_leader_that_reads_another_holder_stops_leading_and_never_writes_over_it():
    """The Lease was deleted and re-created by B (or edited): A's renewal conflicts and its read
    shows B. A stops leading at once, and its next round does not renew over B's record, even
    when B skipped a renewal (a write conditional on B's version would succeed)."""
    now, started = [0.0], []
    lease = NoLeaseYet()
    a = Leadership(lease, "a", TIMING, on_started=lambda: started.append(now[0]), clock=lambda: now[0])
    a.try_acquire_or_renew()
    now[0] = 2.0
    lease.record = LeaderRecord(holder="b", duration_seconds=15, renew_time="b's", transitions=1)
    a.try_acquire_or_renew()
    assert not a.leading(), "two replicas lead: A still says it leads over B's Lease"
    now[0] = 4.0  # B skipped a renewal
    a.try_acquire_or_renew()
    assert lease.record.holder == "b", "A wrote its renewal over B's Lease"
    assert not a.leading() and started == [0.0]


def test_a_stop_while_a_renewal_is_under_way_does_not_take_the_lease_back():
    """stop() releases the Lease while the election thread's renewal is in flight: that renewal
    conflicts with the release, and the round must not read the free Lease and take it again
    (a stopped replica holding it would make the standby wait out the lease duration)."""
    now, started = [0.0], []

    class StoppedMidWrite(NoLeaseYet):
        stop_during_write = False

        def write(self, record, *, timeout):
            if self.stop_during_write:
                self.stop_during_write = False
                stopper = threading.Thread(target=a.stop)
                stopper.start()
                stopper.join(0.5)  # it waits for this round: the release comes after
                self.stopper = stopper
            super().write(record, timeout=timeout)

    lease = StoppedMidWrite()
    a = Leadership(lease, "a", TIMING, on_started=lambda: started.append(now[0]), clock=lambda: now[0])
    a.try_acquire_or_renew()
    now[0], lease.stop_during_write = 2.0, True
    a.try_acquire_or_renew()
    lease.stopper.join(10)
    assert not lease.stopper.is_alive()
    assert lease.record.holder is None, "the stopped replica holds the Lease"
    assert started == [0.0]
    a.try_acquire_or_renew()  # a round after stop() writes nothing
    assert lease.record.holder is None and started == [0.0]


def test_a_standby_dates_what_it_read_when_the_read_returned():
    """A slow read returns a renewal that landed while it was under way: the standby counts the
    lease duration from when it saw it (the read's end), not from when it asked."""
    now = [0.0]
    lease = NoLeaseYet()
    lease.record = LeaderRecord(holder="a", duration_seconds=15, renew_time="t0", transitions=0)

    class SlowFirstRead(NoLeaseYet):
        slow = True

        def read(self, *, timeout):
            if self.slow:
                self.slow, now[0] = False, now[0] + 4.0
            return super().read(timeout=timeout)

    slow = SlowFirstRead()
    slow.record = lease.record
    b = Leadership(slow, "b", TIMING, on_started=lambda: None, clock=lambda: now[0])
    b.try_acquire_or_renew()  # asked at 0, answered at 4
    now[0] = 15.5  # D after the ask, not yet D after the answer: unchanged, but not for D as seen
    b.try_acquire_or_renew()
    assert slow.record.holder == "a" and not b.leading(), "taken over less than D after the renewal was seen"
