"""The outbox relay's side of the ledger (the operator's Relay): claim the dispatch records that
are due, in one transaction the relay holds open while it creates their Jobs, and settle each on
its own (`DispatchOutcomes`)."""

from __future__ import annotations

from retex.ledger.moves import end_attempt, lock_task
from retex.ledger.placement import transition
from retex.ledger.records import Dispatch
from retex.ledger.rows import ClaimedRecord, Cursor, TaskRow, fetch_all
from retex.machine import TaskEvent, TaskPhase

# A record deferred n times waits min(cap, base·2^(n-1)) seconds: a transient refusal of one Job
# costs that record a retry, never the records behind it.
DISPATCH_RETRY_BASE_SECONDS = 1.0
DISPATCH_RETRY_CAP_SECONDS = 60.0


def claim(cur: Cursor, *, limit: int) -> tuple[list[Dispatch], DispatchOutcomes]:
    """Claim unsent dispatch records that are due (`FOR UPDATE SKIP LOCKED`) in the caller's
    transaction (see `Ledger.dispatch_batch`). Returns the records that are still current and
    the `DispatchOutcomes` that settles them; records whose epoch was superseded are marked
    stale here and not returned."""
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
    outcomes = DispatchOutcomes(cur, {row.id: row.attempts for row in rows})
    return [Dispatch(id=r.id, task_uid=r.task_uid, epoch=r.epoch, namespace=r.namespace, name=r.name,
                     spec=r.spec, deadline_at=r.deadline_at, deferred_seconds=r.deferred_seconds,
                     cancel_reason=(r.cancel_reason or "Cancelled") if r.cancel_requested else None)
            for r in rows if r.current], outcomes


class DispatchOutcomes:
    """How the relay settles each claimed record, in the batch's transaction. Each settlement
    runs in its own savepoint, so one that fails leaves the others (and the claim) intact."""

    def __init__(self, cur: Cursor, attempts: dict[int, int]):
        self._cur, self._attempts = cur, attempts
        self.claimed = len(attempts)  # records claimed, settled by the ledger (stale, dropped) or not

    def _settle(self, dispatch: Dispatch, outcome: str) -> None:
        self._cur.execute("UPDATE retex.outbox SET sent_at = now(), outcome = %s WHERE id = %s",
                          (outcome, dispatch.id))

    def _current_task(self, dispatch: Dispatch) -> TaskRow | None:
        task = lock_task(self._cur, dispatch.task_uid)
        if task.epoch != dispatch.epoch or task.phase != TaskPhase.RUNNING:
            return None  # moved on since the claim (replaced, timed out): nothing to end
        return task

    def _end_attempt(self, dispatch: Dispatch, outcome: str, job_name: str | None) -> None:
        """End the attempt of a record that was not sent. `job_name`: a Job was found for it after
        all (a relay died between creating it and its commit, crash-matrix R3) and deleted; its
        worker may be inside a step, so the attempt holds its slot and key until known dead."""
        end_attempt(self._cur, dispatch.task_uid, dispatch.epoch, outcome, settled=job_name is None)
        if job_name is not None:
            self._cur.execute("UPDATE retex.attempts SET job_name = %s WHERE task_uid = %s AND epoch = %s",
                              (job_name, dispatch.task_uid, dispatch.epoch))

    def sent(self, dispatch: Dispatch, job_name: str) -> None:
        with self._cur.connection.transaction():
            self._settle(dispatch, "sent")
            self._cur.execute("UPDATE retex.attempts SET job_name = %s WHERE task_uid = %s AND epoch = %s",
                              (job_name, dispatch.task_uid, dispatch.epoch))

    def rejected(self, dispatch: Dispatch, message: str, *, reason: str = "JobRejected",
                 job_name: str | None = None, actor: str = "operator") -> None:
        """The attempt's Job cannot be created: the API server refused it for good (JobRejected:
        invalid, forbidden, namespace gone), or it could not be dispatched at all (DispatchFailed:
        deferred past the cap, or a failure repeating cannot cure). The task fails with `reason`
        and `message`. Not dead-lettered: no budget was spent; fix the cause, then requeue."""
        with self._cur.connection.transaction():
            task = self._current_task(dispatch)
            if task is not None:
                self._end_attempt(dispatch, "failed", job_name)
                transition(self._cur, task, TaskEvent.FAIL, actor, reason=reason, last_error=message[:4096])
            self._settle(dispatch, "rejected")
            self._cur.execute("UPDATE retex.outbox SET last_error = %s WHERE id = %s", (message[:4096], dispatch.id))

    def dropped(self, dispatch: Dispatch, *, reason: str, job_name: str | None = None,
                actor: str = "operator") -> None:
        """Not sent: the task was cancelled or deleted (`reason` Cancelled or TaskDeleted) or its
        Task object is gone. It ends Cancelled now: no Job of its remains, so no worker will
        reach a step boundary."""
        with self._cur.connection.transaction():
            task = self._current_task(dispatch)
            if task is not None:
                self._end_attempt(dispatch, "cancelled", job_name)
                transition(self._cur, task, TaskEvent.CANCEL, actor, reason=reason, cancel_requested=True)
            self._settle(dispatch, "dropped")

    def deferred(self, dispatch: Dispatch, error: str) -> float:
        """A transient failure (API server busy or unreachable): this record waits out its own
        backoff; the records behind it go on. Returns the delay in seconds. The first deferral's
        time is kept (`deferred_since`): the relay gives the record up past its cap."""
        tries = self._attempts.get(dispatch.id, 0) + 1
        delay = float(min(DISPATCH_RETRY_CAP_SECONDS, DISPATCH_RETRY_BASE_SECONDS * 2 ** (tries - 1)))
        with self._cur.connection.transaction():
            self._cur.execute(
                "UPDATE retex.outbox SET attempts = %s, not_before = now() + make_interval(secs => %s), "
                "last_error = %s, deferred_since = coalesce(deferred_since, now()) WHERE id = %s",
                (tries, delay, error[:4096], dispatch.id),
            )
        return delay
