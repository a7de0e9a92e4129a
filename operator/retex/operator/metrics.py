"""Prometheus metrics of the operator, on RETEX_METRICS_PORT (`/metrics`).

Task, attempt and duration figures come from the ledger at scrape time (cached briefly), so what
workers did reaches Prometheus without scraping short-lived pods, and an operator restart loses
no count. Their counters and histograms are derived from append-only rows plus what purges took
(retex.ledger.LedgerFigures), so none decreases across a requeue, a retry or a purge. Both
replicas export the same ledger figures (aggregate them with max, not sum). Process figures
(errors, rounds, leadership, status-mirror lag) are counted here, per replica. When the ledger
cannot be read, or its read has not ended within SCRAPE_WAIT_SECONDS, the page still answers:
`retex_ledger_up` 0 and the process figures (so `retex_leader` stays and an outage is not
mistaken for no leader), without the ledger's. One family per name, counters named `_total`,
durations in seconds (Prometheus' naming conventions). No label carries a task name or UID:
cardinality stays bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import psycopg
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from retex.ledger import DURATION_BUCKETS as BUCKETS
from retex.ledger import Histogram as LedgerHistogram
from retex.ledger import Ledger, LedgerError, LedgerFigures, LedgerUnavailable
from retex.logs import log_line
from retex.machine import TaskPhase

log = logging.getLogger(__name__)

# A scrape waits at most this long for the ledger read it asked for (under Prometheus' default
# 10 s scrape timeout); a read still under way then goes on in its own thread, and the page
# answers at once without the ledger's figures (retex_ledger_up 0).
SCRAPE_WAIT_SECONDS = 5.0
# The read goes through a Ledger of its own (`metrics_ledger`) with this short retry window (the
# writers' retries run for minutes), after a ping of this many seconds (a refused Postgres would
# otherwise cost the pool's connection wait), and its sessions give up on a lock or a statement
# (METRICS_SESSION), so a read that cannot finish ends and frees its connection.
METRICS_LEDGER_RETRY_SECONDS = 2.0
PING_SECONDS = 2
# libpq connection parameters of the metrics ledger's sessions. Without them a query waits as long
# as the server lets it: behind a migration's ALTER TABLE (an ACCESS EXCLUSIVE lock) the scrape
# waited for ever. The keepalives and tcp_user_timeout end a session whose server went silent
# mid-query (the ping only proves it answered a moment before).
METRICS_SESSION = {
    "connect_timeout": str(PING_SECONDS),
    "options": "-c statement_timeout=4s -c lock_timeout=1s",
    "keepalives": "1", "keepalives_idle": "2", "keepalives_interval": "1", "keepalives_count": "2",
    "tcp_user_timeout": "4000",
    "application_name": "retex-metrics",  # the scrape's sessions, told apart in pg_stat_activity
}

REGISTRY = CollectorRegistry()
LOOP_ERRORS = Counter("retex_reconcile_errors_total", "Failed rounds of an operator loop, by loop",
                      ["loop"], registry=REGISTRY)
POSTGRES_ERRORS = Counter("retex_postgres_errors_total", "Ledger operations that gave up (Postgres unavailable)",
                          ["loop"], registry=REGISTRY)
API_ERRORS = Counter("retex_api_errors_total", "Kubernetes API calls that failed, by loop", ["loop"],
                     registry=REGISTRY)
LOOP_ROUNDS = Counter("retex_loop_rounds_total", "Completed rounds of an operator loop, by loop", ["loop"],
                      registry=REGISTRY)
LEADER = Gauge("retex_leader", "1 while this replica leads (it alone writes), 0 on a standby",
              registry=REGISTRY)
MIRROR_LAG = Histogram("retex_status_mirror_lag_seconds", "From a ledger change seen to its status written",
                       buckets=BUCKETS, registry=REGISTRY)
# Read at scrape time from the status mirror (retex.operator.mirror): unlike MIRROR_LAG, observed
# only once a write lands, it grows while a mirror writes nothing.
MIRROR_PENDING = Gauge("retex_status_mirror_oldest_pending_seconds", "Age of the oldest ledger change not yet "
                       "written to its Task's status; 0 when none waits, and on a standby", registry=REGISTRY)

EVENTS_DROPPED = Counter("retex_events_dropped_total", "Events not posted: the queue of Events waiting to be "
                         "posted was full (a task's end or wait for a human only past 10,000), their post failed "
                         "5 times, they were queued in an earlier leadership of this replica, or left at a stop",
                         registry=REGISTRY)
# Read at scrape time from the status mirror's Event poster.
EVENTS_QUEUED = Gauge("retex_events_queued", "Events waiting to be posted", registry=REGISTRY)
LEDGER_ENDPOINT_REFUSALS = Counter(
    "retex_ledger_endpoint_refusals_total", "Calls and connections the ledger endpoint refused to protect the "
    "others (429 over a pod's or namespace's quota, 503 busy, 408 past the request deadline, a connection over "
    "the caps), by the caller's namespace ('' before its token is known) and reason", ["namespace", "reason"],
    registry=REGISTRY)

# The loops that count failures. Their error series exist from the start (at 0), so a dashboard or an
# alert reads "no errors" before the first one rather than "no data".
LOOPS = ("relay", "promoter", "reaper", "status-mirror", "status-resync", "event-poster", "ledger-listen")
for _loop in LOOPS:
    for _family in (LOOP_ERRORS, POSTGRES_ERRORS, API_ERRORS):
        _family.labels(_loop)


def count_failure(loop: str, error: BaseException) -> None:
    """A failed round of an operator loop, counted by what failed."""
    LOOP_ERRORS.labels(loop).inc()
    if isinstance(error, LedgerError):
        POSTGRES_ERRORS.labels(loop).inc()
    elif isinstance(error, ApiException):
        API_ERRORS.labels(loop).inc()


def metrics_ledger(dsn: str) -> Ledger:
    """The scrape's own Ledger (not yet open): two connections, a short retry window, and sessions
    that give up within seconds (METRICS_SESSION; `options` already in `dsn` are kept, ours after)."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    ours, theirs = METRICS_SESSION["options"], params.get("options")
    params.update(METRICS_SESSION, options=f"{theirs} {ours}" if theirs else ours)
    return Ledger(psycopg.conninfo.make_conninfo("", **params), max_connections=2,
                  retry_for_seconds=METRICS_LEDGER_RETRY_SECONDS)


# What a read of the ledger fails with when the ledger is away, locked or slow: these are
# `retex_ledger_up` 0. Anything else is a bug and fails the scrape, rather than pass for an outage.
LEDGER_DOWN = (psycopg.Error, LedgerUnavailable)


class _Read:
    """One read of the ledger's figures, shared by every scrape that waits for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.figures: LedgerFigures | None = None  # None: the ledger could not be read
        self.bug: BaseException | None = None  # what the read raised that is not the database's


class LedgerCollector:
    """Reads `Ledger.figures` at most every `cache_seconds` and renders it, with `retex_ledger_up`.
    One read at a time, in a thread of its own: a scrape waits for it at most `wait_seconds`, and
    scrapes that come meanwhile wait for the same read. `ledger` should give up within seconds
    (`metrics_ledger`), so a read that hangs ends and the next scrape reads afresh."""

    def __init__(self, ledger: Ledger, cache_seconds: float = 5.0, wait_seconds: float = SCRAPE_WAIT_SECONDS):
        self._ledger, self._cache_seconds, self._wait_seconds = ledger, cache_seconds, wait_seconds
        self._cached: tuple[float, LedgerFigures | None] | None = None  # the last read, and when
        self._reading: _Read | None = None  # the read under way
        self._lock = threading.Lock()  # guards _cached and _reading; never held across a read

    def _figures(self) -> LedgerFigures | None:
        with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] <= self._cache_seconds:
                return self._cached[1]
            read = self._reading
            if read is None:
                read = self._reading = _Read()
                threading.Thread(target=self._read_into, args=(read,), name="metrics-ledger-read", daemon=True).start()
        if not read.done.wait(self._wait_seconds):
            log_line(log, logging.WARNING, "metrics: the ledger read is still under way; answered without it",
                     waited_seconds=self._wait_seconds)
            return None
        if read.bug is not None:
            raise read.bug
        return read.figures

    def _read_into(self, read: _Read) -> None:
        try:
            read.figures = self._read()
        except BaseException as bug:  # the scrapes waiting for it fail with it; nothing is cached
            read.bug = bug
        with self._lock:
            if read.bug is None:
                self._cached = (time.monotonic(), read.figures)
            self._reading = None
        read.done.set()

    def _read(self) -> LedgerFigures | None:
        try:
            self._ledger.ping(timeout=PING_SECONDS)  # refused or silent: no pool wait, no retry
            return self._ledger.figures()
        except LEDGER_DOWN as exc:
            log_line(log, logging.WARNING, "metrics: the ledger could not be read", error=f"{type(exc).__name__}: {exc}")
            return None

    def collect(self) -> Iterator[Metric]:
        figures = self._figures()
        yield GaugeMetricFamily("retex_ledger_up", "1 if this replica read the ledger at its last scrape, 0 if not "
                                "(then the ledger's figures are left out)", value=0 if figures is None else 1)
        if figures is None:
            return
        phases = GaugeMetricFamily("retex_tasks", "Tasks by phase; queue depth is Queued + Scheduled", labels=["phase"])
        for phase in TaskPhase:
            phases.add_metric([str(phase)], figures.tasks_by_phase.get(str(phase), 0))
        yield phases
        yield GaugeMetricFamily("retex_dead_lettered_tasks", "Tasks dead-lettered now (failed for good, not requeued)",
                                value=figures.dead_lettered)
        yield GaugeMetricFamily("retex_frozen_tasks", "Tasks frozen now: their Task showed more than the ledger holds "
                                "(the ledger restored from a backup or lost commits); nothing runs until recovered",
                                value=figures.frozen)
        yield CounterMetricFamily("retex_tasks_submitted", "Tasks admitted into the ledger", value=figures.submitted)
        finished = CounterMetricFamily("retex_tasks_finished", "Times a task reached a terminal phase (again after a "
                                       "requeue)", labels=["outcome"])
        for phase in (TaskPhase.SUCCEEDED, TaskPhase.FAILED, TaskPhase.CANCELLED):
            finished.add_metric([str(phase).lower()], figures.finished_by_phase.get(str(phase), 0))
        yield finished
        yield CounterMetricFamily("retex_tasks_dead_lettered", "Times a task was dead-lettered",
                                  value=figures.dead_lettered_ever)
        attempts = CounterMetricFamily("retex_attempts_started", "Attempts started, by cause", labels=["cause"])
        for cause in ("first", "retry", "disruption", "lease-expired", "requeue"):
            attempts.add_metric([cause], figures.attempts_by_cause.get(cause, 0))
        yield attempts
        yield CounterMetricFamily("retex_lease_expiries", "Attempts replaced because their lease expired",
                                  value=figures.attempts_by_cause.get("lease-expired", 0))
        yield GaugeMetricFamily("retex_outbox_lag_seconds", "Age of the oldest dispatch not yet relayed to a Job",
                                value=figures.outbox_lag_seconds)
        yield GaugeMetricFamily("retex_task_deadline_overrun_seconds", "How long the unfinished task furthest past its "
                                "deadline (first start + timeoutSeconds) has been past it; 0 when none is",
                                value=figures.deadline_overrun_seconds)
        yield _histogram("retex_step_duration_seconds", "Step runs, from begin to commit or failure",
                         figures.step_seconds)
        yield _histogram("retex_task_duration_seconds", "Tasks, from submission to a terminal phase",
                         figures.task_seconds)
        yield _histogram("retex_task_first_step_seconds", "From submission to the first step beginning",
                         figures.first_step_seconds)


def _histogram(name: str, documentation: str, observed: LedgerHistogram) -> HistogramMetricFamily:
    buckets = [(str(bound), count) for bound, count in zip(BUCKETS, observed.cumulative, strict=True)]
    buckets.append(("+Inf", observed.count))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=observed.total)


def serve(ledger: Ledger, port: int) -> None:
    REGISTRY.register(LedgerCollector(ledger))
    start_http_server(port, addr="0.0.0.0", registry=REGISTRY)
