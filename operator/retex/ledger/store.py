"""The ledger's facade, `Ledger`: the only door to the ledger tables, for every caller outside
retex.ledger. Each method runs one operation in one transaction of its own, retried through a
transient error (retex.ledger.transactions). The operations themselves are top-level functions
that take a cursor, split by caller, so a test can run one inside a transaction of its own:

- retex.ledger.operator_operations: admission, attempts, deadlines, human actions, retention
- retex.ledger.outbox: the relay's dispatch batch and how each record is settled
- retex.ledger.worker_operations: the fenced operations a worker asks for through the endpoint
- retex.ledger.witness: tasks frozen when their Task shows more than the ledger holds, their
  recovery, and the install that owns the ledger
- retex.ledger.readers: operations that write nothing
- retex.ledger.placement: run limits, concurrency keys and the task's phase moves
- retex.ledger.moves: the lock, the fence, step moves and history that all of them share

The control plane's writes (admission, the reaper's, the promoter's, the relay's, retention and
the human actions) are the leader's when the Ledger is made with `leader_fenced=True` (the
operator's): each transaction checks the leadership term first (`transactions.check_term`), so a
replica that is no longer the leader writes nothing; it takes a term with `take_term`. Without
it (the CLI's administrator writes, tests, the workers' endpoint ledger) they are not fenced.
Workers' operations are fenced by attempt epoch instead, readers by nothing.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg

from retex.failpoints import failpoint
from retex.ledger import operator_operations, outbox, placement, readers, transactions, worker_operations
from retex.ledger import witness as witness_operations
from retex.ledger.errors import LedgerUnavailable, NotLeader
from retex.ledger.migrate import migrate
from retex.ledger.moves import check_result_size, record_history
from retex.ledger.outbox import DispatchOutcomes
from retex.ledger.records import (
    AdmitResult,
    AttemptRecord,
    Dispatch,
    HistoryEntry,
    LedgerFigures,
    NamespaceQuota,
    NamespaceUsage,
    Refusal,
    StepRecord,
    TaskAdmission,
    TaskRecord,
    WatchedAttempt,
)
from retex.ledger.rows import Cursor
from retex.ledger.transactions import SessionLimits
from retex.machine import TaskPhase

T = TypeVar("T")
P = ParamSpec("P")


class Ledger:
    """The only door to the ledger tables. Thread-safe; one per process."""

    def __init__(self, dsn: str, *, max_connections: int = 10, retry_for_seconds: float = 120.0,
                 limits: SessionLimits | None = None, leader_fenced: bool = False):
        self._retry_for = retry_for_seconds
        self._pool = transactions.connection_pool(dsn, max_connections=max_connections, limits=limits)
        self._dsn = dsn
        self._limits, self._leader_fenced = limits, leader_fenced
        self._term: int | None = None  # the leadership term highest taken (`take_term`)
        self._term_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self, *, migrate_schema: bool = True) -> Ledger:
        if migrate_schema:
            self._retrying(lambda: self._migrate(), op="migrate")
        self._pool.open(wait=False)
        return self

    def _migrate(self) -> list[int]:
        with psycopg.connect(self._dsn) as conn:
            return migrate(conn)

    def close(self) -> None:
        self._pool.close()

    def ping(self, *, timeout: int) -> None:
        """One `SELECT 1` on a connection of its own, within about `timeout` seconds, never retried
        (the readiness probe asks: an outage is its answer, not something to wait out). Not from
        the pool: a pool busy with workers' calls is not Postgres being away. Raises what stopped it."""
        with psycopg.connect(self._dsn, connect_timeout=timeout) as conn:
            conn.execute("SELECT 1")

    def __enter__(self) -> Ledger:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions (retex.ledger.transactions) ---------------------------------------------

    def _retrying(self, fn: Callable[[], T], *, op: str) -> T:
        return transactions.retrying(fn, op=op, retry_for=self._retry_for)

    def _tx(self, fn: Callable[[Cursor], T], *, op: str, leader: bool = False) -> T:
        def attempt() -> T:
            with self._transaction(leader=leader) as cur:
                return fn(cur)

        return self._retrying(attempt, op=op)

    @contextlib.contextmanager
    def _transaction(self, *, leader: bool) -> Iterator[Cursor]:
        """A transaction; a leader's write (`leader`) on a fenced Ledger checks the term first.
        A leader's session the server ended for sitting idle in its transaction (the process
        froze) is refused too: its transaction did not commit, and a successor may lead."""
        fenced = leader and self._leader_fenced
        term = self._term
        try:
            with transactions.transaction(self._pool) as cur:
                if fenced:
                    transactions.check_term(cur, term)
                yield cur
        except psycopg.errors.IdleInTransactionSessionTimeout as cut:
            if not fenced:
                raise
            idle = f" for {self._limits.idle_in_transaction_seconds:g}s" if self._limits else ""
            why = f"the server ended this transaction after it sat idle{idle}: nothing of it was written"
            # A frozen leader's, or a live one's that stalled (no operation makes an API call inside
            # its transaction): asked in a fresh transaction, only a changed term makes it
            # NotLeader; else the loops retry it.
            try:
                with transactions.transaction(self._pool) as cur:
                    current = transactions.current_term(cur)
            except psycopg.Error as exc:
                raise LedgerUnavailable(f"{why}; the leadership term could not be read: {exc}") from cut
            if current != term:
                raise NotLeader(f"{why}; the ledger's leadership term is now {current}", term=term) from cut
            raise LedgerUnavailable(f"{why}; the leadership term is still this replica's") from cut

    def _tx_once(self, fn: Callable[[Cursor], T], *, uid: str, op: str) -> TaskRecord | T:
        return self._tx(transactions.once(fn, uid=uid), op=op, leader=True)

    def _run(self, operation: Callable[Concatenate[Cursor, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`operation(cur, ...)` in one transaction of its own, retried, named after the operation."""
        return self._tx(lambda cur: operation(cur, *args, **kwargs), op=operation.__name__)

    def _lead(self, operation: Callable[Concatenate[Cursor, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """As `_run`, for a write of the control plane's leader: fenced by the leadership term."""
        return self._tx(lambda cur: operation(cur, *args, **kwargs), op=operation.__name__, leader=True)

    # -- leadership (retex.ledger.transactions: check_term, take_term) ---------------------------

    def take_term(self, *, lock_timeout_seconds: float, still_leading: Callable[[], bool] = lambda: True) -> int:
        """Become the ledger's leader: take the next leadership term, after every write of the
        previous leader's term that is under way has committed or ended, and refuse that term's
        writes from now on. One try, not retried: raises LockNotAvailable when the predecessor's
        transactions held the term for `lock_timeout_seconds` (ask again while still leading);
        NotLeader when `still_leading()`, asked holding the term's lock, says no. Terms only grow,
        so the ledger keeps the highest it took: a leftover taker of an earlier leadership that
        returns late does not put an older term back."""
        if not self._leader_fenced:
            raise TypeError("take_term on a Ledger made without leader_fenced=True")
        with transactions.transaction(self._pool) as cur:
            term = transactions.take_term(cur, lock_timeout_seconds=lock_timeout_seconds, still_leading=still_leading)
        with self._term_lock:
            self._term = max(term, self._term or 0)
        return term

    @property
    def term(self) -> int | None:
        """The highest leadership term this Ledger took (None: none yet)."""
        return self._term

    # What an operation of a test's own writes into history (tests/integration/test_ledger_lifecycle.py).
    _history = staticmethod(record_history)

    # -- control plane (retex.ledger.operator_operations, placement) ----------------------------

    def admit(self, admission: TaskAdmission, *, actor: str = "operator",
              quota: NamespaceQuota | None = None) -> AdmitResult:
        """`quota`: what the task's namespace may keep in the ledger; at or over it, the task is
        not admitted (`AdmitResult.over_quota`). None: no limit (the CLI's, tests')."""
        try:
            return self._lead(operator_operations.admit, admission, actor=actor, quota=quota)
        except operator_operations.NotAdmitted as not_admitted:
            return not_admitted.verdict

    def refuse(self, refusal: Refusal) -> Refusal:
        return self._lead(operator_operations.refuse, refusal)

    def replace_attempt(self, uid: str, lost_epoch: int, *, cause: str, actor: str = "operator") -> TaskRecord:
        return self._lead(operator_operations.replace_attempt, uid, lost_epoch, cause=cause, actor=actor)

    def settle_attempt(self, uid: str, epoch: int, *, actor: str = "operator") -> None:
        self._lead(operator_operations.settle_attempt, uid, epoch, actor=actor)

    def fail_unstarted(self, uid: str, epoch: int, error: str, *, actor: str = "operator",
                       rng: random.Random | None = None) -> TaskRecord:
        return self._lead(operator_operations.fail_unstarted, uid, epoch, error, actor=actor, rng=rng)

    def cancel_unheld(self, uid: str, epoch: int, *, actor: str = "operator") -> TaskRecord:
        return self._lead(operator_operations.cancel_unheld, uid, epoch, actor=actor)

    def promote_due(self, *, limit: int = 100, actor: str = "operator") -> list[str]:
        return self._lead(operator_operations.promote_due, limit=limit, actor=actor)

    def purge_finished(self, *, older_than_seconds: float, batch: int = operator_operations.PURGE_BATCH) -> int:
        """History retention, `batch` tasks at a time, each batch a fenced transaction of its own,
        until none is due: a large purge holds the leadership term a batch at a time, so a
        successor's take_term waits for one batch, not for the whole purge. NotLeader (the term
        moved on) ends it; the batches before it stay done. Returns how many went."""
        purged = 0
        while True:
            went = self._lead(operator_operations.purge_finished, older_than_seconds=older_than_seconds, limit=batch)
            purged += went
            if went < batch:
                return purged

    def request_cancel(self, uid: str, *, reason: str = "Cancelled", actor: str = "operator") -> TaskRecord:
        if reason not in operator_operations.CANCEL_REASONS:
            raise ValueError(f"cancel reason {reason!r} is not one of {', '.join(operator_operations.CANCEL_REASONS)}")
        return self._lead(operator_operations.request_cancel, uid, reason=reason, actor=actor)

    def fail_task(self, uid: str, *, reason: str, message: str, actor: str = "operator") -> TaskRecord:
        return self._lead(operator_operations.fail_task, uid, reason=reason, message=message, actor=actor)

    def abandon(self, uid: str, *, reason: str, actor: str = "operator") -> TaskRecord | None:
        return self._lead(operator_operations.abandon, uid, reason=reason, actor=actor)

    def requeue(self, uid: str, *, actor: str) -> TaskRecord:
        return self._tx_once(lambda cur: operator_operations.requeue(cur, uid, actor=actor), uid=uid, op="requeue")

    def resolve_step(self, uid: str, step_name: str, *, mark_done: bool, result: Any = None,
                     actor: str) -> TaskRecord:
        return self._tx_once(
            lambda cur: operator_operations.resolve_step(cur, uid, step_name, mark_done=mark_done, result=result,
                                                         actor=actor),
            uid=uid, op="resolve_step")

    # -- the Task as the ledger's witness; the install that owns the ledger (retex.ledger.witness) --

    def freeze(self, uid: str, *, reason: str, witness: dict[str, Any], shown_version: int,
               actor: str = "operator") -> TaskRecord:
        return self._lead(witness_operations.freeze, uid, reason=reason, witness=witness, shown_version=shown_version,
                          actor=actor)

    def admit_lost(self, admission: TaskAdmission, *, witness: dict[str, Any], shown_version: int,
                   actor: str = "operator") -> TaskRecord | AdmitResult:
        """The task frozen (LedgerLost), or the final verdict that stands for its uid instead."""
        try:
            record = self._lead(witness_operations.admit_lost, admission, witness=witness,
                                shown_version=shown_version, actor=actor)
        except operator_operations.NotAdmitted as not_admitted:
            return not_admitted.verdict
        if record is None:
            raise LookupError(f"task {admission.uid} neither admitted nor refused")
        return record

    def recover(self, uid: str, *, from_status: bool, actor: str, min_epoch: int = 0) -> TaskRecord:
        return self._lead(witness_operations.recover, uid, from_status=from_status, actor=actor, min_epoch=min_epoch)

    def claim_install(self, *, uid: str, namespace: str, adopt_from: str | None) -> None:
        """At every start, before the replica competes for the term: raises InstallMismatch for
        a ledger another install owns."""
        self._run(witness_operations.claim_install, uid=uid, namespace=namespace, adopt_from=adopt_from)

    def set_run_limits(self, *, max_running: int | None, max_running_per_namespace: int | None) -> None:
        """The leader's configuration, written as it takes the term: a standby started with other
        settings changes nothing."""
        self._lead(placement.set_run_limits, max_running=max_running, max_running_per_namespace=max_running_per_namespace)

    def set_namespace_run_limit(self, namespace: str, max_running: int | None) -> None:
        """A namespace's own run limit (its TaskPolicy's maxRunning; None: none), the leader's write."""
        self._lead(placement.set_namespace_run_limit, namespace, max_running)

    def replace_namespace_run_limits(self, limits: dict[str, int]) -> None:
        """Every namespace's own run limit, those left out having none: the leader's, as it takes the term."""
        self._lead(placement.replace_namespace_run_limits, limits)

    def fill_slots(self, *, actor: str = "operator") -> None:
        """Start what may start: the periodic backstop for a placement that skipped a briefly
        locked queue head (SKIP LOCKED) or a slot freed where no placement followed."""
        self._lead(placement.fill_slots, actor)

    # -- the outbox relay (retex.ledger.outbox) --------------------------------------------------

    def dispatch_batch(self, *, limit: int, claim_seconds: float) -> tuple[list[Dispatch], DispatchOutcomes]:
        """Claim up to `limit` unsent dispatch records that are due (`FOR UPDATE SKIP LOCKED`) for
        `claim_seconds`, in a short transaction of their own that commits before this returns.

        Returns the records that are still current and a `DispatchOutcomes` on which the caller
        settles each record on its own, each in a fenced transaction of its own: sent, rejected
        (the task fails), dropped (the task is cancelled) or deferred (that record alone is
        retried later). Records whose epoch was superseded are marked stale and not returned; a
        record of a task whose cancel was requested carries its cancel reason (the relay drops
        it, after looking for a Job a dead relay may have created). A record left unsettled
        (the caller died, or stopped leading) is claimed again once its claim lapses; the
        deterministic Job name turns the repeated create into AlreadyExists, which is success.
        """
        def claim(cur: Cursor) -> outbox.Claim:
            claimed = outbox.claim(cur, limit=limit, claim_seconds=claim_seconds)
            for dispatch in claimed.dispatches:  # a leader frozen holding its claims' locks
                failpoint("in-dispatch-batch", task=dispatch.name, uid=dispatch.task_uid)
            return claimed

        claimed = self._tx(claim, op="dispatch_batch", leader=True)
        return claimed.dispatches, DispatchOutcomes(claimed, self._settle_dispatch)

    def _settle_dispatch(self, settle: Callable[[Cursor], T]) -> T:
        return self._tx(settle, op="settle_dispatch", leader=True)

    # -- the worker's operations (retex.ledger.worker_operations) ----------------------------------

    def claim_attempt(self, uid: str, epoch: int, *, pod: str, node: str | None) -> TaskRecord:
        return self._run(worker_operations.claim_attempt, uid, epoch, pod=pod, node=node)

    def begin_step(self, uid: str, epoch: int, idx: int, *, actor: str, request: str | None = None) -> StepRecord:
        prior, name = self._run(worker_operations.begin_step, uid, epoch, idx, actor=actor, request=request)
        failpoint("after-begin-commit", prior.name, task=name, uid=uid)  # crash-matrix R8b: committed, no reply
        return prior

    def start_run(self, uid: str, epoch: int, idx: int, *, actor: str) -> None:
        self._run(worker_operations.start_run, uid, epoch, idx, actor=actor)

    def seconds_until_step_deadline(self, uid: str, idx: int, *, begun_at: datetime | None,
                                    after_seconds: float) -> float:
        return self._run(worker_operations.seconds_until_step_deadline, uid, idx, begun_at=begun_at,
                         after_seconds=after_seconds)

    def commit_step(self, uid: str, epoch: int, idx: int, result: Any, *, actor: str) -> None:
        check_result_size(result)
        with worker_operations.refusal_as_unstorable():
            self._run(worker_operations.commit_step, uid, epoch, idx, result, actor=actor)

    def fail_step(self, uid: str, epoch: int, idx: int, error: str, *, retryable: bool, actor: str,
                  rng: random.Random | None = None) -> TaskRecord:
        with worker_operations.refusal_as_unstorable():
            return self._run(worker_operations.fail_step, uid, epoch, idx, error, retryable=retryable, actor=actor,
                             rng=rng)

    def flag_step(self, uid: str, epoch: int, idx: int, why: str, *, actor: str) -> TaskRecord:
        with worker_operations.refusal_as_unstorable():
            return self._run(worker_operations.flag_step, uid, epoch, idx, why, actor=actor)

    def complete_task(self, uid: str, epoch: int, *, actor: str) -> TaskRecord:
        return self._run(worker_operations.complete_task, uid, epoch, actor=actor)

    def finish_cancelled(self, uid: str, epoch: int, *, actor: str) -> TaskRecord:
        return self._run(worker_operations.finish_cancelled, uid, epoch, actor=actor)

    # -- readers (retex.ledger.readers) ------------------------------------------------------

    def get(self, uid: str) -> TaskRecord:
        return self._run(readers.get, uid)

    def find(self, namespace: str, name: str) -> TaskRecord | None:
        return self._run(readers.find, namespace, name)

    def running(self) -> list[TaskRecord]:
        return self._run(readers.running)

    def versions(self) -> dict[str, int]:
        return self._run(readers.versions)

    def dead_lettered_uids(self) -> set[str]:
        return self._run(readers.dead_lettered_uids)

    def phases_of(self, uids: list[str]) -> dict[str, tuple[str, TaskPhase]]:
        return self._run(readers.phases_of, uids)

    def attempts(self, uid: str) -> list[AttemptRecord]:
        return self._run(readers.attempts, uid)

    def history(self, uid: str) -> list[HistoryEntry]:
        return self._run(readers.history, uid)

    def dead_letters(self, namespace: str | None = None) -> list[TaskRecord]:
        return self._run(readers.dead_letters, namespace)

    def watched(self) -> list[WatchedAttempt]:
        return self._run(readers.watched)

    def next_due_at(self) -> datetime | None:
        return self._run(readers.next_due_at)

    def seconds_until(self, at: datetime) -> float:
        return self._run(readers.seconds_until, at)

    def prior_verdict(self, admission: TaskAdmission) -> AdmitResult | None:
        return self._run(readers.prior_verdict, admission)

    def refusal(self, uid: str) -> Refusal | None:
        return self._run(readers.refusal, uid)

    def namespace_usage(self, namespace: str) -> NamespaceUsage:
        return self._run(readers.namespace_usage, namespace)

    def figures(self) -> LedgerFigures:
        return self._run(readers.figures)

    def listen(self, *, timeout: float = 1.0) -> Iterator[tuple[str, int] | None]:
        return readers.listen(self._dsn, timeout=timeout)
