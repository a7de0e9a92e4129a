"""What every background loop of the operator shares: a thread body that runs rounds, can be
woken early and stopped, survives a failed round (counted, logged, retried a second later), and
runs no round unless `may_write()` says so (the leader election's answer: a standby writes
nothing, and a leader past its renew deadline starts no round). A round under way when this
replica stopped leading is refused at its next write (`STOPPED_LEADING`: the ledger's term fence,
or a Kubernetes write not sent) and ends there, quietly: not a failure. It keeps the times the health
probes judge it by (retex.operator.health): when its current round started, and when it last
passed (a round completed, or a standby's idle check)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from retex.failpoints import failpoint
from retex.kube.operator_calls import NotLeading
from retex.ledger import LedgerError, NotLeader
from retex.logs import log_line
from retex.operator.metrics import LOOP_ROUNDS, count_failure

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_SECONDS = 1.0
FOLLOWER_RECHECK_SECONDS = 1.0  # a standby looks again this often (becoming leader also wakes it)
# A write refused because this replica no longer leads: stop the round, ask `may_write` again.
STOPPED_LEADING = (NotLeader, NotLeading)


class Loop:
    name = "loop"
    period = 5.0  # the longest pause between two rounds (a subclass sets its own): the probes' yardstick

    def __init__(self) -> None:
        self.wake = threading.Event()  # set it to run the next round now rather than at its interval
        self._stop = threading.Event()
        self.may_write: Callable[[], bool] = lambda: True  # the Runtime sets the election's answer
        # The Runtime's: a write refused NotLeader while this replica may still think it leads.
        self.on_not_leader: Callable[[NotLeader], None] = lambda refused: None
        self.round_started_at: float | None = None  # monotonic; None between rounds
        self.last_pass_at = time.monotonic()  # a round completed, or a standby found it may not write

    def round(self) -> float:
        """One pass; returns how long to wait before the next (unless woken)."""
        raise NotImplementedError

    def run(self) -> None:
        delay = 0.0
        while not self.stopping:
            self.pause(delay)
            if self.stopping:
                return
            if not self.may_write():
                self.last_pass_at = time.monotonic()
                delay = FOLLOWER_RECHECK_SECONDS
                continue
            self.round_started_at = time.monotonic()
            try:
                failpoint("in-loop-round", self.name)  # a test hangs a round here (=hang): the liveness probe
                delay = self.round()
                LOOP_ROUNDS.labels(self.name).inc()
                self.last_pass_at = time.monotonic()
            except STOPPED_LEADING as exc:
                log_line(log, logging.WARNING, "not the leader: round abandoned", loop=self.name, why=str(exc))
                if isinstance(exc, NotLeader):
                    self.on_not_leader(exc)
                delay = FOLLOWER_RECHECK_SECONDS
            except LedgerError as exc:
                count_failure(self.name, exc)
                log_line(log, logging.WARNING, "ledger unavailable", loop=self.name, error=str(exc))
                delay = RETRY_AFTER_FAILURE_SECONDS
            except Exception as exc:  # the API server down or refusing, or a bug: try again soon
                count_failure(self.name, exc)
                log_line(log, logging.ERROR, "round failed; retrying", loop=self.name, exc_info=True)
                delay = RETRY_AFTER_FAILURE_SECONDS
            finally:
                self.round_started_at = None

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def pause(self, seconds: float) -> None:
        """Sleep until `seconds` pass, the loop is woken, or it is stopped."""
        self.wake.wait(seconds)
        self.wake.clear()
