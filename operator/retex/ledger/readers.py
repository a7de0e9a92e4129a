"""The ledger's readers: operations that write nothing. Each takes a cursor of the caller's
transaction (`Ledger` runs it in one of its own), except `listen`, which holds a connection of
its own. The other operations read their records here too (`get`, `step_record`)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import psycopg

from retex.ledger.errors import TaskNotFound
from retex.ledger.records import (
    DURATION_BUCKETS,
    AdmitResult,
    AttemptRecord,
    Histogram,
    HistoryEntry,
    LedgerFigures,
    NamespaceUsage,
    Refusal,
    StepRecord,
    TaskAdmission,
    TaskRecord,
    TaskRef,
    WatchedAttempt,
)
from retex.ledger.rows import Cursor, StepRow, TaskRow, column_list, fetch_all, fetch_one, one, scalar
from retex.machine import StepState, TaskPhase

NOTIFY_CHANNEL = "retex_ledger"
_ENDED_PHASES = "('Succeeded', 'Failed', 'Cancelled')"


_TASK = f"SELECT {column_list(TaskRow)} FROM retex.tasks"
_STEPS = f"SELECT {column_list(StepRow)} FROM retex.steps WHERE task_uid = %s ORDER BY idx"


def get(cur: Cursor, uid: str) -> TaskRecord:
    row = fetch_one(cur, TaskRow, f"{_TASK} WHERE uid = %s", (uid,))
    if row is None:
        raise TaskNotFound(uid)
    return task_record(row, fetch_all(cur, StepRow, _STEPS, (uid,)))


def find(cur: Cursor, namespace: str, name: str) -> TaskRecord | None:
    """The newest task of that namespace/name (a name can be reused after deletion)."""
    row = cur.execute(
        "SELECT uid FROM retex.tasks WHERE namespace = %s AND name = %s ORDER BY created_at DESC LIMIT 1",
        (namespace, name),
    ).fetchone()
    return get(cur, row[0]) if row else None


def running(cur: Cursor) -> list[TaskRecord]:
    """Every Running task (without steps): what the lease reaper watches over."""
    rows = fetch_all(cur, TaskRow, f"{_TASK} WHERE phase = 'Running' ORDER BY uid")
    return [task_record(row, []) for row in rows]


def versions(cur: Cursor) -> dict[str, int]:
    """uid → ledger version of every task: what a status resync compares against."""
    return {uid: version for uid, version in cur.execute("SELECT uid, version FROM retex.tasks")}


def dead_lettered_uids(cur: Cursor) -> set[str]:
    """uids of the dead-lettered tasks: what a status resync checks the dead-letter label against."""
    return {uid for (uid,) in cur.execute("SELECT uid FROM retex.tasks WHERE dead_lettered")}


def phases_of(cur: Cursor, uids: list[str]) -> dict[str, tuple[str, TaskPhase]]:
    """uid → (namespace, phase) of those of `uids` the ledger holds: the status mirror's write order."""
    return {uid: (namespace, TaskPhase(phase)) for uid, namespace, phase in cur.execute(
        "SELECT uid, namespace, phase FROM retex.tasks WHERE uid = ANY(%s)", (uids,))}


def attempts(cur: Cursor, uid: str) -> list[AttemptRecord]:
    return fetch_all(cur, AttemptRecord, f"SELECT {column_list(AttemptRecord)} FROM retex.attempts "
                     "WHERE task_uid = %s ORDER BY epoch", (uid,))


def history(cur: Cursor, uid: str) -> list[HistoryEntry]:
    return fetch_all(cur, HistoryEntry, f"SELECT {column_list(HistoryEntry)} FROM retex.history "
                     "WHERE task_uid = %s ORDER BY id", (uid,))


def dead_letters(cur: Cursor, namespace: str | None) -> list[TaskRecord]:
    """Failed tasks that were dead-lettered (out of retries or disruptions), without steps;
    of one namespace, or of all when `namespace` is None. Oldest failure first."""
    rows = fetch_all(
        cur, TaskRow,
        f"""{_TASK} WHERE phase = 'Failed' AND dead_lettered
            AND (%(ns)s::text IS NULL OR namespace = %(ns)s) ORDER BY finished_at, namespace, name""",
        {"ns": namespace},
    )
    return [task_record(row, []) for row in rows]


def watched(cur: Cursor) -> list[WatchedAttempt]:
    """What the reaper watches: the current attempt of every Running task, and every attempt
    the operator ended that is not yet known dead (it holds its slot and key until then)."""
    # Named as WatchedAttempt's fields (class_row matches by name).
    return fetch_all(
        cur, WatchedAttempt,
        """SELECT t.uid, t.namespace, t.name, a.epoch, t.phase = 'Running' AND a.epoch = t.epoch AS current,
                  t.cancel_requested, a.job_name,
                  extract(epoch FROM now() - o.sent_at)::float8 AS dispatched_seconds_ago
           FROM retex.attempts a JOIN retex.tasks t ON t.uid = a.task_uid
           LEFT JOIN retex.outbox o ON o.task_uid = a.task_uid AND o.epoch = a.epoch AND o.outcome = 'sent'
           WHERE (t.phase = 'Running' AND a.epoch = t.epoch AND a.outcome IS NULL)
              OR (a.outcome IS NOT NULL AND a.settled_at IS NULL)
           ORDER BY t.uid, a.epoch""")


def next_due_at(cur: Cursor) -> datetime | None:
    """The next moment something is due (a Scheduled or Retrying task, or a task deadline):
    the promoter sleeps until then instead of keeping a timer per task. A frozen task is never
    due (the promoter leaves it alone): counted, it would wake the promoter at once, for ever."""
    at: datetime | None = scalar(cur.execute(
        """SELECT least(
               (SELECT min(not_before) FROM retex.tasks WHERE phase IN ('Scheduled', 'Retrying')
                AND frozen_reason IS NULL),
               (SELECT min(deadline_at) FROM retex.tasks
                WHERE phase NOT IN ('Succeeded', 'Failed', 'Cancelled') AND frozen_reason IS NULL))"""
    ))
    return at


def seconds_until(cur: Cursor, at: datetime) -> float:
    """`at` minus the database's now(): time left measured on the ledger's clock, the one
    that set `at` (a deadline), never the caller's wall clock."""
    seconds: float = scalar(cur.execute("SELECT extract(epoch FROM %s - now())::float8", (at,)))
    return seconds


def prior_verdict(cur: Cursor, admission: TaskAdmission) -> AdmitResult | None:
    """What `admit` answers for a Task it will never admit, without writing: refused before,
    purged, or a duplicate of the task (live or purged) that used its idempotencyKey first.
    None: `admit` would admit it (or has). The operator asks before its Job dry run, so that a
    decision made once is not made again differently."""
    uid = admission.uid
    stored = refusal(cur, uid)
    if stored is not None:
        return AdmitResult(uid=uid, created=False, refusal=stored)
    if cur.execute("SELECT 1 FROM retex.tombstones WHERE uid = %s", (uid,)).fetchone():
        # It ran to its end and its history was purged (retention): never run it again.
        return AdmitResult(uid=uid, created=False, purged=True)
    if admission.idempotency_key is None:
        return None
    first = fetch_one(
        cur, TaskRef,
        """SELECT uid, namespace, name FROM retex.tasks
           WHERE namespace = %(ns)s AND idempotency_key = %(key)s AND uid <> %(uid)s
           UNION ALL
           SELECT uid, namespace, name FROM retex.tombstones
           WHERE namespace = %(ns)s AND idempotency_key = %(key)s AND uid <> %(uid)s
           LIMIT 1""",
        {"ns": admission.namespace, "key": admission.idempotency_key, "uid": uid},
    )
    if first is None:
        return None
    return AdmitResult(uid=first.uid, created=False, duplicate_of=first)


def namespace_usage(cur: Cursor, namespace: str) -> NamespaceUsage:
    """What a namespace keeps in the ledger now (nothing for a namespace never seen)."""
    row = cur.execute("SELECT tasks, result_bytes FROM retex.namespace_usage WHERE namespace = %s",
                      (namespace,)).fetchone()
    return NamespaceUsage(tasks=row[0], result_bytes=row[1]) if row else NamespaceUsage(tasks=0, result_bytes=0)


def refusal(cur: Cursor, uid: str) -> Refusal | None:
    """The refusal stored for `uid`, or None."""
    return fetch_one(cur, Refusal, f"SELECT {column_list(Refusal)} FROM retex.refusals WHERE uid = %s", (uid,))


def figures(cur: Cursor) -> LedgerFigures:
    """What the operator exports as metrics, computed from committed state (so worker-side
    figures need no scraping of short-lived pods). Counts come from append-only rows plus what
    purges took (LedgerFigures says which figures are counts)."""
    phases = {phase: n for phase, n in cur.execute("SELECT phase, count(*) FROM retex.tasks GROUP BY phase")}
    dead = scalar(cur.execute("SELECT count(*) FROM retex.tasks WHERE dead_lettered"))
    frozen = scalar(cur.execute("SELECT count(*) FROM retex.tasks WHERE frozen_reason IS NOT NULL"))
    # A frozen task's dispatch is held on purpose (its own alert says so), not a relay falling behind.
    lag = scalar(cur.execute("SELECT extract(epoch FROM now() - min(created_at)) FROM retex.outbox "
                             "WHERE sent_at IS NULL AND task_uid NOT IN "
                             "(SELECT uid FROM retex.tasks WHERE frozen_reason IS NOT NULL)"))
    # The promoter fails a task at its deadline: one left unfinished past it means that did not happen.
    overrun = scalar(cur.execute(f"SELECT extract(epoch FROM now() - min(deadline_at)) FROM retex.tasks "
                                 f"WHERE deadline_at <= now() AND phase NOT IN {_ENDED_PHASES}"))
    counts = tallies(cur, None)
    for metric, label, value in cur.execute("SELECT metric, label, value FROM retex.purged_tallies"):
        counts[(metric, label)] = counts.get((metric, label), 0.0) + value

    def labelled(metric: str) -> dict[str, int]:
        return {label: int(value) for (m, label), value in counts.items() if m == metric}

    def histogram(metric: str) -> Histogram:
        return Histogram(count=int(counts.get((metric, "count"), 0)), total=counts.get((metric, "sum"), 0.0),
                         cumulative=[int(counts.get((metric, f"le={float(b)}"), 0)) for b in DURATION_BUCKETS])

    return LedgerFigures(
        tasks_by_phase=phases,
        dead_lettered=dead,
        frozen=frozen,
        outbox_lag_seconds=float(lag or 0.0),
        deadline_overrun_seconds=float(overrun or 0.0),
        submitted=int(counts.get(("submitted", ""), 0)),
        finished_by_phase=labelled("finished"),
        dead_lettered_ever=int(counts.get(("dead_lettered", ""), 0)),
        attempts_by_cause=labelled("attempts"),
        step_seconds=histogram("step_seconds"),
        task_seconds=histogram("task_seconds"),
        first_step_seconds=histogram("first_step_seconds"),
    )


def tallies(cur: Cursor, uids: list[str] | None) -> dict[tuple[str, str], float]:
    """Counts from append-only rows (history, attempts) of the tasks `uids` (None: every task),
    keyed (metric, label); a histogram as labels `count`, `sum` and `le=<bound>`. A requeue or a
    retry only adds rows, so none of these goes down but by a purge (which keeps what it took)."""
    params = {"uids": uids}

    def of(column: str) -> str:
        return "TRUE" if uids is None else f"{column} = ANY(%(uids)s)"

    counted: dict[tuple[str, str], float] = {}

    def add(metric: str, label: str, value: float) -> None:
        counted[(metric, label)] = counted.get((metric, label), 0.0) + float(value)

    def histogram(metric: str, seconds_sql: str) -> None:
        bounds = ", ".join(f"count(*) FILTER (WHERE s <= {float(b)}) AS le{i}" for i, b in enumerate(DURATION_BUCKETS))
        count, total, *cumulative = one(cur.execute(
            f"SELECT count(*), coalesce(sum(s), 0), {bounds} FROM ({seconds_sql}) AS d", params))
        add(metric, "count", count)
        add(metric, "sum", total)
        for bound, below in zip(DURATION_BUCKETS, cumulative, strict=True):
            add(metric, f"le={float(bound)}", below)

    add("submitted", "", scalar(cur.execute(f"SELECT count(*) FROM retex.history WHERE event = 'admit' AND "
                                            f"{of('task_uid')}", params)))
    ended = f"h.to_state IN {_ENDED_PHASES} AND h.event NOT LIKE 'step-%%' AND {of('h.task_uid')}"
    for to_state, n, dead in cur.execute(
            f"SELECT h.to_state, count(*), count(*) FILTER (WHERE h.detail->>'deadLettered' = 'true') "
            f"FROM retex.history h WHERE {ended} GROUP BY h.to_state", params):
        add("finished", to_state, n)
        add("dead_lettered", "", dead)
    add("dead_lettered", "", 0)
    for cause, n in cur.execute(f"SELECT cause, count(*) FROM retex.attempts WHERE {of('task_uid')} GROUP BY cause",
                                params):
        add("attempts", cause, n)
    histogram("task_seconds", f"SELECT extract(epoch FROM h.at - t.created_at) AS s FROM retex.history h "
                              f"JOIN retex.tasks t ON t.uid = h.task_uid WHERE {ended}")
    # A step run: from its latest begin to the commit or failure that ended it.
    histogram("step_seconds", f"""SELECT extract(epoch FROM e.at - b.at) AS s FROM retex.history e
                                  CROSS JOIN LATERAL (SELECT at FROM retex.history b WHERE b.task_uid = e.task_uid
                                      AND b.step_idx = e.step_idx AND b.event = 'step-begin' AND b.id < e.id
                                      ORDER BY b.id DESC LIMIT 1) AS b
                                  WHERE e.event IN ('step-commit', 'step-fail') AND {of('e.task_uid')}""")
    histogram("first_step_seconds", f"SELECT extract(epoch FROM min(h.at) - t.created_at) AS s FROM retex.history h "
                                    f"JOIN retex.tasks t ON t.uid = h.task_uid WHERE h.event = 'step-begin' AND "
                                    f"{of('h.task_uid')} GROUP BY t.uid, t.created_at")
    return counted


def listen(dsn: str, *, timeout: float) -> Iterator[tuple[str, int] | None]:
    """Yield (uid, version) for every committed change; None every `timeout` without one.

    Ends with the error that ended its connection (a Postgres restart, a terminated backend,
    a payload it cannot read): the caller listens again, and changes made while nobody
    listened are the periodic resync's job, which is why a caller must not rely on this alone.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        while True:
            got = False
            for note in conn.notifies(timeout=timeout, stop_after=1):
                uid, _, version = note.payload.rpartition(" ")
                got = True
                yield uid, int(version)
            if not got:
                yield None


def step_record(row: StepRow) -> StepRecord:
    return StepRecord(idx=row.idx, name=row.name, state=StepState(row.state), attempt=row.attempt,
                      idempotency_key=row.idempotency_key, result=row.result, error=row.error,
                      started_at=row.started_at, finished_at=row.finished_at)


def task_record(row: TaskRow, steps: list[StepRow]) -> TaskRecord:
    return TaskRecord(
        uid=row.uid, namespace=row.namespace, name=row.name, spec=row.spec, spec_hash=row.spec_hash,
        phase=TaskPhase(row.phase), reason=row.reason, dead_lettered=row.dead_lettered, epoch=row.epoch,
        failures=row.failures, disruptions=row.disruptions, max_attempts=row.max_attempts,
        max_disruptions=row.max_disruptions, not_before=row.not_before, concurrency_key=row.concurrency_key,
        priority=row.priority, deadline_at=row.deadline_at, cancel_requested=row.cancel_requested,
        last_error=row.last_error, version=row.version, created_at=row.created_at, updated_at=row.updated_at,
        started_at=row.started_at, finished_at=row.finished_at, steps=tuple(step_record(s) for s in steps),
        frozen_reason=row.frozen_reason, witness=row.witness)
