"""The outbox relay's side of the ledger (the operator's Relay): claim the dispatch records that
are due in a short transaction (`claim`), and settle each on its own in a short transaction of
its own (`DispatchOutcomes`); the relay makes its API calls between the two, outside any
transaction, so a slow API server holds no lock and no transaction of the ledger open.

A claim is the record's `not_before` set to when the claim lapses: a claimed record is not due,
so no other relay claims it meanwhile, and the claims of a relay that died lapse and are claimed
again. The expiry is also the claim's mark: each claim of a record writes a later one, so a
settlement that finds the record unsent with its claim's expiry still there knows that nobody
claimed it since."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar

from retex.ledger.moves import end_attempt, lock_task
from retex.ledger.placement import transition
from retex.ledger.records import Dispatch
from retex.ledger.rows import ClaimedRecord, Cursor, TaskRow, fetch_all, scalar
from retex.machine import TaskEvent, TaskPhase

T = TypeVar("T")

# A record deferred n times waits min(cap, base·2^(n-1)) seconds: a transient refusal of one Job
# costs that record a retry, never the records behind it.
DISPATCH_RETRY_BASE_SECONDS = 1.0
DISPATCH_RETRY_CAP_SECONDS = 60.0


@dataclass(frozen=True)
class Claim:
    """What one claim handed out: the records still current, and what settles them."""

    dispatches: list[Dispatch]
    until: datetime | None  # the claim's expiry, written to each record's not_before (None: none current)
    attempts: dict[int, int]  # deferrals so far, by record id
    claimed: int  # records claimed, those marked stale included


def claim(cur: Cursor, *, limit: int, claim_seconds: float) -> Claim:
    """Claim unsent dispatch records that are due (`FOR UPDATE SKIP LOCKED`) in the caller's
    transaction (see `Ledger.dispatch_batch`) for `claim_seconds`. Records whose epoch was
    superseded are marked stale here and not handed out."""
    # Named as ClaimedRecord's fields (class_row matches by name).
    rows = fetch_all(
        cur, ClaimedRecord,
        """SELECT o.id, o.task_uid, o.epoch, o.attempts, t.namespace, t.name, t.spec, t.deadline_at,
                  extract(epoch FROM now() - o.deferred_since)::float8 AS deferred_seconds,
                  t.cancel_requested, t.cancel_reason, (o.epoch = t.epoch AND t.phase = 'Running') AS current
           FROM retex.outbox o JOIN retex.tasks t ON t.uid = o.task_uid
           WHERE o.sent_at IS NULL AND (o.not_before IS NULL OR o.not_before <= now())
           ORDER BY o.id LIMIT %s FOR UPDATE OF o SKIP LOCKED""",
        (limit,),
    )
    stale = [row.id for row in rows if not row.current]
    if stale:
        cur.execute("UPDATE retex.outbox SET sent_at = now(), outcome = 'stale' WHERE id = ANY(%s)", (stale,))
    current = [row for row in rows if row.current]
    until = None
    if current:
        until = scalar(cur.execute("SELECT now() + make_interval(secs => %s)", (claim_seconds,)))
        cur.execute("UPDATE retex.outbox SET not_before = %s WHERE id = ANY(%s)", (until, [r.id for r in current]))
    return Claim(
        dispatches=[Dispatch(id=r.id, task_uid=r.task_uid, epoch=r.epoch, namespace=r.namespace, name=r.name,
                             spec=r.spec, deadline_at=r.deadline_at, deferred_seconds=r.deferred_seconds,
                             cancel_reason=(r.cancel_reason or "Cancelled") if r.cancel_requested else None)
                    for r in current],
        until=until, attempts={row.id: row.attempts for row in current}, claimed=len(rows))


class Transact(Protocol):
    """Runs an operation in a transaction of its own: the Ledger's, fenced by the leadership term."""

    def __call__(self, operation: Callable[[Cursor], T], /) -> T: ...


class DispatchOutcomes:
    """How the relay settles each claimed record: each in a transaction of its own (`transact`),
    which first locks the task row and the record and checks the record is still this claim's.
    When it is not — settled already, claimed again by another relay after this claim lapsed, or
    held since (its task frozen, retex.ledger.witness) — the settlement writes nothing and says so
    (False; `deferred`: None)."""

    def __init__(self, claimed: Claim, transact: Transact):
        self._claim, self._transact = claimed, transact
        self.claimed = claimed.claimed  # records claimed, settled by the ledger (stale) or handed out

    def _held(self, cur: Cursor, dispatch: Dispatch) -> TaskRow | None:
        """The task, locked, while the record is unsent and still carries this claim's expiry.
        The task row is locked before its record, the order every operation takes them in."""
        task = lock_task(cur, dispatch.task_uid)
        held = cur.execute("SELECT 1 FROM retex.outbox WHERE id = %s AND sent_at IS NULL AND not_before = %s "
                           "FOR UPDATE", (dispatch.id, self._claim.until)).fetchone()
        return task if held else None

    @staticmethod
    def _settle(cur: Cursor, dispatch: Dispatch, outcome: str) -> None:
        cur.execute("UPDATE retex.outbox SET sent_at = now(), outcome = %s WHERE id = %s", (outcome, dispatch.id))

    @staticmethod
    def _current(task: TaskRow, dispatch: Dispatch) -> bool:
        """False: the task moved on since the claim (replaced, timed out), so there is nothing to end."""
        return task.epoch == dispatch.epoch and task.phase == TaskPhase.RUNNING

    @staticmethod
    def _end_attempt(cur: Cursor, dispatch: Dispatch, outcome: str, job_name: str | None) -> None:
        """End the attempt of a record that was not sent. `job_name`: a Job was found for it after
        all (a relay died between creating it and settling the record, crash-matrix R3) and
        deleted; its worker may be inside a step, so the attempt holds its slot and key until
        known dead."""
        end_attempt(cur, dispatch.task_uid, dispatch.epoch, outcome, settled=job_name is None)
        if job_name is not None:
            cur.execute("UPDATE retex.attempts SET job_name = %s WHERE task_uid = %s AND epoch = %s",
                        (job_name, dispatch.task_uid, dispatch.epoch))

    def sent(self, dispatch: Dispatch, job_name: str) -> bool:
        def settle(cur: Cursor) -> bool:
            if self._held(cur, dispatch) is None:
                return False
            self._settle(cur, dispatch, "sent")
            cur.execute("UPDATE retex.attempts SET job_name = %s WHERE task_uid = %s AND epoch = %s",
                        (job_name, dispatch.task_uid, dispatch.epoch))
            return True

        return self._transact(settle)

    def rejected(self, dispatch: Dispatch, message: str, *, reason: str = "JobRejected",
                 job_name: str | None = None, actor: str = "operator") -> bool:
        """The attempt's Job cannot be created: the API server refused it for good (JobRejected:
        invalid, forbidden, namespace gone), or it could not be dispatched at all (DispatchFailed:
        deferred past the cap, or a failure repeating cannot cure). The task fails with `reason`
        and `message`. Not dead-lettered: no budget was spent; fix the cause, then requeue."""
        def settle(cur: Cursor) -> bool:
            task = self._held(cur, dispatch)
            if task is None:
                return False
            if self._current(task, dispatch):
                self._end_attempt(cur, dispatch, "failed", job_name)
                transition(cur, task, TaskEvent.FAIL, actor, reason=reason, last_error=message[:4096])
            self._settle(cur, dispatch, "rejected")
            cur.execute("UPDATE retex.outbox SET last_error = %s WHERE id = %s", (message[:4096], dispatch.id))
            return True

        return self._transact(settle)

    def dropped(self, dispatch: Dispatch, *, reason: str, job_name: str | None = None,
                actor: str = "operator") -> bool:
        """Not sent: the task was cancelled or deleted (`reason` Cancelled or TaskDeleted) or its
        Task object is gone. It ends Cancelled now: no Job of its remains, so no worker will
        reach a step boundary."""
        def settle(cur: Cursor) -> bool:
            task = self._held(cur, dispatch)
            if task is None:
                return False
            if self._current(task, dispatch):
                self._end_attempt(cur, dispatch, "cancelled", job_name)
                transition(cur, task, TaskEvent.CANCEL, actor, reason=reason, cancel_requested=True)
            self._settle(cur, dispatch, "dropped")
            return True

        return self._transact(settle)

    def deferred(self, dispatch: Dispatch, error: str) -> float | None:
        """A transient failure (API server busy or unreachable): this record waits out its own
        backoff (its not_before, which ends the claim); the records behind it go on. Returns the
        delay in seconds. The first deferral's time is kept (`deferred_since`): the relay gives
        the record up past its cap."""
        tries = self._claim.attempts.get(dispatch.id, 0) + 1
        delay = float(min(DISPATCH_RETRY_CAP_SECONDS, DISPATCH_RETRY_BASE_SECONDS * 2 ** (tries - 1)))

        def settle(cur: Cursor) -> bool:
            if self._held(cur, dispatch) is None:
                return False
            cur.execute(
                "UPDATE retex.outbox SET attempts = %s, not_before = now() + make_interval(secs => %s), "
                "last_error = %s, deferred_since = coalesce(deferred_since, now()) WHERE id = %s",
                (tries, delay, error[:4096], dispatch.id),
            )
            return True

        return delay if self._transact(settle) else None
