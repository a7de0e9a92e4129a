"""The ledger endpoint's quotas, on a clock the test turns: a token bucket per pod and per
namespace, calls in flight per pod and per namespace, connections per address; and the ledger
threads shared by the namespaces in turn."""

from __future__ import annotations

import asyncio

import pytest

from retex.operator.endpoint_limits import Admission, ConnectionCount, FairSlots, Quota, ReplyBudget, TokenBucket


def test_a_bucket_gives_its_burst_at_once_then_its_rate_and_says_how_long_to_wait():
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == 0.5
    assert bucket.take(0.25) == 0.25  # half a token back: half the wait left
    assert bucket.take(0.5) == 0.0
    assert bucket.take(100.0) == 0.0 and bucket.tokens == 2.0, "refilled to its burst, never past it"


def test_a_pod_over_its_rate_is_refused_and_another_pod_of_its_namespace_is_not():
    admission = Admission(per_pod=Quota(rate=1, burst=2, concurrent=10), per_namespace=Quota(rate=100, burst=100,
                                                                                               concurrent=10))
    for _ in range(2):
        assert admission.admit("shop", "a", 0.0) is None
        admission.release("shop", "a")
    refused = admission.admit("shop", "a", 0.0)
    assert refused is not None and (refused.scope, refused.why) == ("pod", "rate") and refused.retry_after == 1.0
    assert admission.admit("shop", "b", 0.0) is None


def test_a_namespace_over_its_rate_is_refused_whatever_pod_calls_and_spends_no_pods_token():
    admission = Admission(per_pod=Quota(rate=1, burst=1, concurrent=10), per_namespace=Quota(rate=1, burst=2,
                                                                                            concurrent=10))
    assert admission.admit("shop", "a", 0.0) is None
    assert admission.admit("shop", "b", 0.0) is None
    refused = admission.admit("shop", "c", 0.0)
    assert refused is not None and refused.scope == "namespace"
    assert admission.admit("bank", "d", 0.0) is None
    assert admission.admit("shop", "c", 1.0) is None, "c's own token was not spent on the refused call"


def test_calls_in_flight_are_capped_per_pod_and_per_namespace_and_released_calls_free_their_place():
    admission = Admission(per_pod=Quota(rate=100, burst=100, concurrent=1), per_namespace=Quota(rate=100, burst=100,
                                                                                               concurrent=2))
    assert admission.admit("shop", "a", 0.0) is None
    assert admission.admit("shop", "a", 0.0) == admission.admit("shop", "a", 0.0)
    refused = admission.admit("shop", "a", 0.0)
    assert refused is not None and (refused.scope, refused.why) == ("pod", "concurrency")
    assert admission.admit("shop", "b", 0.0) is None
    refused = admission.admit("shop", "c", 0.0)
    assert refused is not None and (refused.scope, refused.why) == ("namespace", "concurrency")
    admission.release("shop", "a")
    assert admission.admit("shop", "c", 0.0) is None


def test_connections_are_capped_per_address_and_in_total():
    count = ConnectionCount(total=3, per_address=2)
    assert count.open("10.0.0.1") and count.open("10.0.0.1")
    assert not count.open("10.0.0.1")
    assert count.open("10.0.0.2")
    assert not count.open("10.0.0.3"), "the total is reached"
    count.close("10.0.0.1")
    assert count.open("10.0.0.3")
    count.close("10.0.0.9")  # never counted: changes nothing
    assert not count.open("10.0.0.4")


def test_a_namespace_alone_takes_every_ledger_thread_and_waits_only_when_all_are_taken():
    async def scenario():
        slots = FairSlots(3)
        for _ in range(3):
            await asyncio.wait_for(slots.acquire("busy"), 1)
        fourth = asyncio.ensure_future(slots.acquire("busy"))
        await asyncio.sleep(0)
        assert not fourth.done() and slots.waiting == 1
        slots.release()
        await asyncio.wait_for(fourth, 1)
        assert slots.free == 0 and slots.waiting == 0

    asyncio.run(scenario())


def test_a_freed_ledger_thread_goes_to_the_namespaces_waiting_in_turn_not_to_the_longest_line():
    async def scenario():
        slots = FairSlots(1)
        await slots.acquire("busy")
        served: list[str] = []

        async def call(namespace: str) -> None:
            await slots.acquire(namespace)
            served.append(namespace)

        calls = [asyncio.ensure_future(call("busy")) for _ in range(3)]
        await asyncio.sleep(0)
        calls.append(asyncio.ensure_future(call("quiet")))
        await asyncio.sleep(0)
        for _ in range(4):
            slots.release()
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*calls), 1)
        assert served == ["busy", "quiet", "busy", "busy"], "the quiet namespace is served second, not last"

    asyncio.run(scenario())


def test_a_call_cut_off_while_waiting_gives_up_its_place_and_a_thread_given_as_it_was_cut_off_goes_on():
    async def scenario():
        slots = FairSlots(1)
        await slots.acquire("a")
        waiting = asyncio.ensure_future(slots.acquire("b"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert slots.waiting == 0
        given = asyncio.ensure_future(slots.acquire("c"))
        after = asyncio.ensure_future(slots.acquire("d"))
        await asyncio.sleep(0)
        slots.release()  # the thread goes to c ...
        given.cancel()  # ... which is cut off before it runs: the thread goes on to d
        with pytest.raises(asyncio.CancelledError):
            await given
        await asyncio.wait_for(after, 1)
        assert slots.free == 0

    asyncio.run(scenario())


def test_a_large_reply_waits_for_room_in_its_namespaces_share_and_the_total_and_a_small_one_always_fits():
    budget = ReplyBudget(total=100, per_namespace=60, small=10)
    assert budget.reserve("shop", 50)
    assert not budget.reserve("shop", 20)  # over the namespace's share
    assert budget.reserve("bank", 40)
    assert not budget.reserve("bank", 20)  # over the total
    assert budget.reserve("shop", 10) and budget.reserve("bank", 10)  # small: always
    budget.release("shop", 50)
    assert budget.reserve("shop", 40) and budget.held == 100
