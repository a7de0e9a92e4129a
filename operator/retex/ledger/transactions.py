"""The pool, transactions and retries: how an operation reaches Postgres.

Every operation is one transaction, idempotent when repeated. Idempotency is what makes the
transient-error retry safe: when a connection drops during COMMIT the caller cannot know whether
it landed, so the operation runs again and must find its own effect already there. An operation
whose repetition would be refused instead is run `once`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from retex.ledger import readers
from retex.ledger.errors import LedgerUnavailable, NotLeader
from retex.ledger.moves import lock_task
from retex.ledger.records import TaskRecord
from retex.ledger.rows import Cursor, scalar
from retex.logs import log_line

log = logging.getLogger(__name__)
T = TypeVar("T")

# Transient: the operation did not happen or will be found done when repeated. A read-only
# session is one on a primary demoted by a switchover (now a standby): `transaction` drops it, and
# the retry reconnects to whichever host of the DSN takes writes now.
TRANSIENT = (psycopg.OperationalError, psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected,
             psycopg.errors.ReadOnlySqlTransaction)


@dataclass(frozen=True)
class SessionLimits:
    """How long a session of this process may keep what it locked without making progress
    (`Ledger(..., limits=...)`: the operator's). A process that freezes inside a transaction
    (SIGSTOP, a lost node whose connections stay open) would keep its row locks, and the
    leadership term's, for ever: the server ends a transaction idle for
    `idle_in_transaction_seconds`, cancels a statement that waited `lock_timeout_seconds` for a
    lock (a frozen client's statement queued behind another frozen session, or behind anyone's
    idle transaction), and probes an idle connection's peer after about
    `idle_in_transaction_seconds` (TCP keepalives), so a vanished one's session ends too."""

    idle_in_transaction_seconds: float
    lock_timeout_seconds: float

    def settings(self) -> dict[str, str]:
        """The server-side session settings (SET per connection)."""
        idle = max(1, round(self.idle_in_transaction_seconds))
        return {"idle_in_transaction_session_timeout": _milliseconds(self.idle_in_transaction_seconds),
                "lock_timeout": _milliseconds(self.lock_timeout_seconds),
                "tcp_keepalives_idle": str(idle),
                "tcp_keepalives_interval": str(max(1, round(idle / 3))),
                "tcp_keepalives_count": "3"}


def _milliseconds(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def connection_pool(dsn: str, *, max_connections: int,
                    limits: SessionLimits | None = None) -> ConnectionPool[psycopg.Connection[TupleRow]]:
    """Not yet open (`Ledger.open` opens it after migrating); rows come as tuples (named rows
    are read with retex.ledger.rows' row types)."""
    return ConnectionPool(
        dsn,
        connection_class=psycopg.Connection[TupleRow],
        min_size=1,
        max_size=max_connections,
        check=_check_if_idle,  # drop connections a Postgres restart broke
        reset=_note_returned,
        configure=functools.partial(_configure, limits=limits),
        open=False,
        name="retex-ledger",
    )


# A connection returned to the pool this recently is handed out again unchecked: the check is a
# round trip per transaction otherwise. One a Postgres restart broke meanwhile fails its first
# statement, a transient error the operation's retry takes to another connection (the pool
# replaces the broken one).
CHECK_AFTER_IDLE_SECONDS = 2.0
_returned_at: weakref.WeakKeyDictionary[psycopg.Connection[TupleRow], float] = weakref.WeakKeyDictionary()


def _note_returned(conn: psycopg.Connection[TupleRow]) -> None:
    _returned_at[conn] = time.monotonic()


def _check_if_idle(conn: psycopg.Connection[TupleRow]) -> None:
    returned = _returned_at.get(conn)
    if returned is None or time.monotonic() - returned > CHECK_AFTER_IDLE_SECONDS:
        ConnectionPool.check_connection(conn)


def _configure(conn: psycopg.Connection[TupleRow], *, limits: SessionLimits | None) -> None:
    """Durable commits: a worker moves on to the next external effect once its commit returns, so
    the commit must be on disk by then: with synchronous_commit=off a crash could lose an
    acknowledged step and the step would run again. Stronger server settings (remote_write,
    remote_apply) are kept. With `limits`, its settings too."""
    if scalar(conn.execute("SHOW synchronous_commit")) == "off":
        conn.execute("SET synchronous_commit = on")
    for name, value in (limits.settings() if limits else {}).items():
        conn.execute("SELECT set_config(%s, %s, false)", (name, value))
    conn.commit()


def check_term(cur: Cursor, term: int | None) -> None:
    """The first statement of a leader's write: the ledger's term must still be `term`, else
    NotLeader. FOR SHARE, kept to the end of the transaction: `take_term` waits for every
    transaction that passed this check, so once a successor's term is taken none of its
    predecessor's writes is still to commit, and each one after is refused."""
    current = scalar(cur.execute("SELECT term FROM retex.leadership FOR SHARE"))
    if term != current:
        raise NotLeader(f"the ledger's leadership term is {current}, this writer's is {term}" if term is not None
                        else f"this writer has taken no leadership term (the ledger's is {current})", term=term)


def current_term(cur: Cursor) -> int:
    """The ledger's leadership term now (no lock)."""
    term: int = scalar(cur.execute("SELECT term FROM retex.leadership"))
    return term


def take_term(cur: Cursor, *, lock_timeout_seconds: float, still_leading: Callable[[], bool]) -> int:
    """Take the next leadership term: the predecessor's writes under way commit first (or are
    ended by the server); its later ones are refused. Raises LockNotAvailable when they have
    not within `lock_timeout_seconds` (the caller tries again while it still leads).

    `still_leading()` is asked *holding the term's row lock*, right before the increment, and
    NotLeader raised when it says no: no other replica can take a term between that answer and
    this increment, so a replica deposed while it waited cannot take the term after its
    successor's (and a pause after the answer holds the lock, so the successor's take waits,
    until the server ends this idle transaction or it commits first)."""
    cur.execute("SELECT set_config('lock_timeout', %s, true)", (_milliseconds(lock_timeout_seconds),))
    current = scalar(cur.execute("SELECT term FROM retex.leadership FOR UPDATE"))
    if not still_leading():
        raise NotLeader(f"not taking the leadership term after {current}: this replica no longer leads")
    term: int = scalar(cur.execute("UPDATE retex.leadership SET term = term + 1 RETURNING term"))
    return term


@contextlib.contextmanager
def transaction(pool: ConnectionPool[psycopg.Connection[TupleRow]]) -> Iterator[Cursor]:
    """A cursor in a transaction on a pooled connection: committed when the block ends, rolled
    back when it raises."""
    with pool.connection(timeout=10) as conn:
        try:
            with conn.transaction(), conn.cursor() as cur:
                yield cur
        except psycopg.errors.ReadOnlySqlTransaction:
            conn.close()  # the pool replaces a closed connection instead of handing this session out again
            raise


def retrying(fn: Callable[[], T], *, op: str, retry_for: float) -> T:
    """`fn()`, tried again after a transient error with capped backoff for `retry_for` seconds;
    then LedgerUnavailable."""
    deadline = time.monotonic() + retry_for
    delay = 0.05
    while True:
        try:
            return fn()
        except TRANSIENT as exc:
            if time.monotonic() + delay > deadline:
                raise LedgerUnavailable(f"{op}: Postgres unavailable for {retry_for:.0f}s: {exc}") from exc
            log_line(log, logging.WARNING, "ledger: transient error, retrying", operation=op, retry_in_seconds=round(delay, 2),
                     error=str(exc))
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 2.0)


def once(fn: Callable[[Cursor], T], *, uid: str) -> Callable[[Cursor], TaskRecord | T]:
    """`fn` for an operation on task `uid` whose repetition would be refused (a human action that
    moves the task on), to be retried as a whole: when a retry follows a COMMIT whose reply was
    lost, the earlier try's transaction is found committed, so the retry returns the task as it
    is instead of trying again."""
    earlier: list[str] = []  # the id of the transaction of the latest try

    def first_time(cur: Cursor) -> TaskRecord | T:
        if earlier:
            # The task row lock waits out a COMMIT still under way (every try takes that lock).
            lock_task(cur, uid)
            status = scalar(cur.execute("SELECT pg_xact_status(%s::xid8)", (earlier[0],)))
            if status == "committed":
                return readers.get(cur, uid)
        earlier[:] = [scalar(cur.execute("SELECT pg_current_xact_id()::text"))]
        return fn(cur)

    return first_time
