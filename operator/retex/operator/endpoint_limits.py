"""What one caller may take of the ledger endpoint, so that no tenant stalls or starves another.

Every authenticated call is admitted against its pod's quota and its namespace's: a token bucket
(calls per second, with a burst) and a count of calls admitted and not yet answered. A call past
either is refused with the seconds after which a retry can succeed (429 Retry-After), so a flood
costs the endpoint one cheap refusal per call. An admitted call then waits for one of the ledger's
threads (`FairSlots`): a free thread goes to the namespaces with calls waiting in turn, so a
namespace alone may use every thread and a busy one cannot keep another's calls behind its queue.

Pure: the clock is passed in, and everything runs on the endpoint's event loop (no locks).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field

# Keys (pods, namespaces) remembered at most; past it, the idle ones (no call in flight, bucket
# full again) are forgotten, which loses nothing: a forgotten key starts with a full bucket.
MAX_KEYS = 50_000


@dataclass(frozen=True)
class Quota:
    rate: float  # calls per second, sustained
    burst: int  # calls at once after a quiet spell
    concurrent: int  # calls in flight at once


@dataclass(frozen=True)
class Refused:
    scope: str  # "pod" or "namespace": whose quota the call is over
    why: str  # "rate" or "concurrency"
    retry_after: float  # seconds


class TokenBucket:
    """`burst` tokens, refilled at `rate` per second; a call takes one."""

    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.stamp = float(burst), now

    def take(self, now: float) -> float:
        """0 if a token was taken; else the seconds until one will be there (none is taken)."""
        self._refill(now)
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate

    def give_back(self) -> None:
        self.tokens = min(self.burst, self.tokens + 1)

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now


@dataclass
class _Account:
    bucket: TokenBucket
    in_flight: int = 0


@dataclass
class _Book:
    """The accounts of one kind of key (pods, or namespaces) under one quota."""

    quota: Quota
    scope: str
    accounts: dict[str, _Account] = field(default_factory=dict)

    def account(self, key: str, now: float) -> _Account:
        found = self.accounts.get(key)
        if found is None:
            if len(self.accounts) >= MAX_KEYS:
                self.accounts = {k: a for k, a in self.accounts.items() if a.in_flight or not a.bucket.full(now)}
            found = self.accounts[key] = _Account(TokenBucket(self.quota.rate, self.quota.burst, now))
        return found


class Admission:
    """Admits a call of (namespace, pod) or says why not; `release` when the call is over."""

    def __init__(self, per_pod: Quota, per_namespace: Quota):
        self._books = (_Book(per_pod, "pod"), _Book(per_namespace, "namespace"))

    def admit(self, namespace: str, pod: str, now: float) -> Refused | None:
        accounts = [book.account(key, now) for book, key in zip(self._books, (f"{namespace}/{pod}", namespace),
                                                                strict=True)]
        for book, account in zip(self._books, accounts, strict=True):
            if account.in_flight >= book.quota.concurrent:
                # A call in flight ends within the endpoint's request deadline; a short wait is
                # enough, and the client's backoff spreads the retries.
                return Refused(book.scope, "concurrency", 1.0)
        taken: list[_Account] = []
        for book, account in zip(self._books, accounts, strict=True):
            wait = account.bucket.take(now)
            if wait:
                for earlier in taken:  # the pod's token is not spent on a call its namespace refused
                    earlier.bucket.give_back()
                return Refused(book.scope, "rate", wait)
            taken.append(account)
        for account in accounts:
            account.in_flight += 1
        return None

    def release(self, namespace: str, pod: str) -> None:
        for book, key in zip(self._books, (f"{namespace}/{pod}", namespace), strict=True):
            account = book.accounts.get(key)
            if account is not None and account.in_flight:
                account.in_flight -= 1


class ConnectionCount:
    """Open connections, in total and per source address."""

    def __init__(self, total: int, per_address: int):
        self.total, self.per_address = total, per_address
        self._open: dict[str, int] = {}
        self._count = 0

    def open(self, address: str) -> bool:
        if self._count >= self.total or self._open.get(address, 0) >= self.per_address:
            return False
        self._open[address] = self._open.get(address, 0) + 1
        self._count += 1
        return True

    def close(self, address: str) -> None:
        left = self._open.get(address, 0) - 1
        if left < 0:
            return
        self._count -= 1
        if left:
            self._open[address] = left
        else:
            del self._open[address]


class FairSlots:
    """`slots` ledger threads shared by the namespaces. A call takes a free one at once when no
    call waits; else it waits in its namespace's line, and each thread let go goes to the next
    namespace in turn that has a call waiting (round robin), the oldest call of that namespace."""

    def __init__(self, slots: int):
        self.free = slots
        self._lines: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(line) for line in self._lines.values())

    async def acquire(self, namespace: str) -> None:
        if self.free and not self._lines:
            self.free -= 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lines.setdefault(namespace, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # given a thread as it was cancelled: the thread goes on to the next
            else:
                line = self._lines.get(namespace)
                if line is not None and turn in line:
                    line.remove(turn)
                    if not line:
                        del self._lines[namespace]
            raise

    def release(self) -> None:
        while self._lines:
            namespace, line = next(iter(self._lines.items()))
            turn = line.popleft()
            if line:
                self._lines.move_to_end(namespace)  # its next call waits for every other namespace's turn
            else:
                del self._lines[namespace]
            if not turn.done():
                turn.set_result(None)
                return
        self.free += 1



class ReplyBudget:
    """Bytes of the replies being written, in total and per namespace. A reply's bytes stay in
    memory until its caller has read them (or the request deadline cuts it off): without a
    bound, enough pods reading the largest replies slowly would hold more than the operator has.
    A reply that does not fit is not sent (the caller retries); one of at most `small` bytes
    always fits, so no write's answer is ever held back (those are bounded by the connections)."""

    def __init__(self, total: int, per_namespace: int, small: int):
        self.total, self.per_namespace, self.small = total, per_namespace, small
        self._held: dict[str, int] = {}
        self.held = 0

    def reserve(self, namespace: str, size: int) -> bool:
        mine = self._held.get(namespace, 0)
        if size > self.small and (self.held + size > self.total or mine + size > self.per_namespace):
            return False
        self._held[namespace] = mine + size
        self.held += size
        return True

    def release(self, namespace: str, size: int) -> None:
        left = self._held.get(namespace, 0) - size
        if left > 0:
            self._held[namespace] = left
        else:
            self._held.pop(namespace, None)
        self.held -= size
